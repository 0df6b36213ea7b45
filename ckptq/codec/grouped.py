"""The grouped operations: many parameters' Adam(W) steps in one backend call (``contract.StepGroup`` and
``contract.DenseGroup``), and one-state steps (SGD, Lion, Muon: ``contract.MomentumGroup``). Everything about the members is checked once, when the group is made
(``check_group``); a step then checks only what changes from call to call (the gradients), and hands
the group to one backend: the C kernels split all its members' blocks over their thread pool, Triton
runs one launch over a table of chunks. Backends without a grouped kernel step the members one by one.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..errors import UsageError
from ..kernels import backend_torch, contract, registry, rules
from ..kernels.contract import DenseGroup, StepGroup, is_flat
from . import ops, policy


def check_group(group: StepGroup) -> None:
    """UsageError unless every member fits the group: its codes and scales laid out for its elements and
    rows at the group's widths and block size, on one device, contiguous; codebooks of 2**bits entries."""
    if len(group.codebooks) != len(group.bits) or len(group.bits) not in (2, 3):
        raise UsageError("a step group takes 2 or 3 moments, each with its codebooks and code width")
    _check_members(group.members, group.codebooks, group.bits, group.block_size)


def _check_members(members, codebooks, widths, block_size: int) -> None:
    policy.check_block_size(block_size)
    for cb, bits in zip(codebooks, widths):
        ops.check_bits(bits)
        ops.check_codebook(cb.qmap, bits)
        ops.check_codebook(cb.encode, bits)
        if cb.thresholds.shape != (2**bits - 1,) or cb.thresholds.dtype != torch.float32:
            raise UsageError(f"thresholds must be fp32 midpoints of the encode codebook ({2**bits - 1} entries)")
    if len({m.p.device for m in members}) > 1 or len({m.p.dtype for m in members}) > 1:
        raise UsageError("a step group's parameters must share one device and one dtype")
    for i, m in enumerate(members):
        n = m.p.numel()
        if not m.p.is_contiguous() or m.p.dim() != 1 or len(m.codes) != len(widths) or len(m.absmax) != len(widths):
            raise UsageError(f"member {i} of a step group: a flat contiguous param and one codes/scales pair per state")
        for k, (codes, absmax, bits) in enumerate(zip(m.codes, m.absmax, widths)):
            ops.check_quantized(codes, absmax, codebooks[k].qmap, block_size, bits, n, m.row_len)
            if codes.device != m.p.device or not codes.is_contiguous() or not absmax.is_contiguous() \
                    or absmax.dtype != torch.float32:
                raise UsageError(f"member {i}, state {k}: contiguous codes and fp32 scales on the param's device")


def _check_call(group: StepGroup) -> None:
    """What may change between calls: one gradient per member, fitting it; hyper rows; seeds."""
    if len(group.grads) != len(group.members) or group.hyper.shape != (len(group.members), len(contract.HYPER_FIELDS)):
        raise UsageError(f"a step of {len(group.members)} parameters needs as many gradients and hyper rows "
                         f"[{len(group.members)}, {len(contract.HYPER_FIELDS)}]")
    dtypes = {g.dtype for g in group.grads}
    for m, g in zip(group.members, group.grads):
        if g.numel() != m.p.numel() or g.device != m.p.device or not g.is_contiguous():
            raise UsageError(f"a gradient of {g.numel()} elements on {g.device} does not fit its parameter "
                             f"({m.p.numel()} elements on {m.p.device}); pass contiguous gradients")
    if len(dtypes) > 1:
        raise UsageError(f"a step group's gradients must share one dtype, got {sorted(map(str, dtypes))}")


def _backend(group_device: torch.device, dtypes: Sequence[torch.dtype], thresholds, flat: bool, backend: str):
    """The module that steps a group: Triton's grouped kernels, the C backend (its grouped call), or the
    reference, as ``ops`` would pick for one of its members."""
    impl = ops._implementation(ops.resolve_backend(backend, group_device), dtypes, thresholds, flat)
    if impl.__name__.endswith("backend_triton"):
        from ..kernels import triton_group

        return triton_group
    return impl


def step_group(group: StepGroup, backend: str = "auto") -> None:
    """One low-bit Adam(W) step of every member, in place; equal bit for bit to ``ops.adam8bit_step`` of each
    member with its hyper row, seed and row length. ``check_group`` must have passed for these members."""
    if not group.members:
        return
    _check_call(group)
    first = group.members[0]
    flat = all(is_flat(m.p.numel(), m.row_len, group.block_size) for m in group.members)
    impl = _backend(first.p.device, (first.p.dtype, group.grads[0].dtype),
                    [cb.thresholds for cb in group.codebooks], flat, backend)
    if hasattr(impl, "adam_step_group"):
        impl.adam_step_group(group)
    else:
        _one_by_one(impl, group)


def _one_by_one(impl, group: StepGroup) -> None:
    """The grouped step as per-member calls (a backend without a grouped kernel)."""
    hyper = group.hyper.to("cpu")
    seeds = None if group.seeds is None else group.seeds.tolist()
    for i, (m, g) in enumerate(zip(group.members, group.grads)):
        states = tuple(contract.StepState(c, a, cb.qmap, cb.thresholds, cb.encode, bits)
                       for c, a, cb, bits in zip(m.codes, m.absmax, group.codebooks, group.bits))
        flags = contract.StepFlags(group.block_size, group.ratio, group.maximize,
                                   None if seeds is None else seeds[i], m.row_len)
        impl.adam_step(m.p, g, states, hyper[i], flags)


def dense_group(group: DenseGroup, backend: str = "auto") -> None:
    """The Adam(W) step of parameters with plain fp32 moments, in place (``backend_torch.adam_dense_step``
    of each, bit for bit)."""
    if not group.params:
        return
    p = group.params[0]
    impl = _backend(p.device, (p.dtype, group.grads[0].dtype), (), True, backend)
    (impl if hasattr(impl, "adam_dense_group") else backend_torch).adam_dense_group(group)


def check_momentum_group(group: contract.MomentumGroup) -> None:
    """``check_group`` for a one-state group: one codes/scales pair per member, one codebook."""
    if any(len(m.codes) != 1 or len(m.absmax) != 1 for m in group.members):
        raise UsageError("a one-state step group takes one codes/scales pair per member")
    # the Adam group's checks, with the one state standing in for both moments
    doubled = tuple(m._replace(codes=m.codes * 2, absmax=m.absmax * 2) for m in group.members)
    check_group(contract.StepGroup(doubled, (), torch.empty(0, 10), None, (group.codebooks,) * 2, (group.bits,) * 2,
                                   group.block_size, False, group.maximize, {}))


def momentum_group(group: contract.MomentumGroup, backend: str = "auto") -> None:
    """One low-bit step of a one-state optimizer for every member, in place; equal bit for bit to
    ``ops.momentum_step`` of each member with its hyper row, seed, out and row length. ``check_momentum_group``
    must have passed for these members."""
    if not group.members:
        return
    n = len(group.members)
    if len(group.grads) != n or group.hyper.shape != (n, len(contract.MOMENTUM_FIELDS)) \
            or len(group.outs) != (n if group.update == contract.UPDATE_NONE else 0):
        raise UsageError(f"a one-state step of {n} parameters needs as many gradients (and outs for UPDATE_NONE) "
                         f"and hyper rows [{n}, {len(contract.MOMENTUM_FIELDS)}]")
    _check_call(group._replace(hyper=torch.empty(n, len(contract.HYPER_FIELDS))))
    first = group.members[0]
    flat = all(is_flat(m.p.numel(), m.row_len, group.block_size) for m in group.members)
    impl = ops.momentum_backend(ops.resolve_backend(backend, first.p.device), (first.p.dtype, group.grads[0].dtype),
                                group.codebooks.thresholds, flat)
    if impl.__name__.endswith("backend_triton"):
        from ..kernels import triton_group

        impl = triton_group if hasattr(triton_group, "momentum_step_group") else impl
    if hasattr(impl, "momentum_step_group"):
        impl.momentum_step_group(group)
        return
    hyper = group.hyper.to("cpu")
    for i, (p, g, state, _, out, flags) in enumerate(contract.momentum_steps(group)):
        impl.momentum_step(p, g, state, hyper[i], out, flags)


# ---- The one step of every rule (``contract.Group`` / ``contract.Dense``; ``ckptq.kernels.rules``) ----

def check(group: contract.Group) -> None:
    """UsageError unless the group is one its rule can step: as many slots as the rule's flags name, each
    with codebooks of 2**bits entries and valid transforms, and every member fitting them (``check_group``'s
    checks per slot)."""
    rule = rules.RULES.get(group.rule)
    if rule is None:
        raise UsageError(f"no rule {group.rule!r}; the rules are {', '.join(rules.RULES)}")
    names = rule.states(group.flags)
    if len(group.slots) != len(names):
        raise UsageError(f"rule {rule.name} with flags {group.flags} steps {len(names)} states ({', '.join(names)}), "
                         f"got {len(group.slots)}")
    for j, s in enumerate(group.slots):
        if s.decode not in (contract.NONE, contract.SQRT, contract.RATIO) or s.encode_as not in (
                contract.NONE, contract.SQRT, contract.RATIO):
            raise UsageError(f"slot {j}: unknown transform")
        for transform in (s.decode, s.encode_as):
            if transform == contract.RATIO and not (0 <= s.divisor < len(group.slots) and s.divisor != j
                                                    and group.slots[s.divisor].encode_as == contract.SQRT):
                raise UsageError(f"slot {j} is a ratio whose divisor {s.divisor} is not a sqrt slot of the group")
    _check_members(group.members, [contract.StepCodebooks(s.qmap, s.thresholds, s.encode) for s in group.slots],
                   [s.bits for s in group.slots], group.block_size)


def _check_step_call(group: contract.Group, rule, n_states: int) -> None:
    n = len(group.members)
    if len(group.grads) != n or group.hyper.shape != (n, len(rule.fields)):
        raise UsageError(f"a step of {n} parameters needs as many gradients and hyper rows [{n}, {len(rule.fields)}]")
    wants_outs = rules.writes_direction(rule, group.flags)
    if len(group.outs) != (n if wants_outs else 0):
        raise UsageError(f"rule {rule.name} {'writes' if wants_outs else 'does not write'} a direction: pass "
                         f"{'one fp32 out per member' if wants_outs else 'no outs'}")
    _check_call(StepGroup(group.members, group.grads, torch.empty(n, len(contract.HYPER_FIELDS)), None, (), (), 0,
                          False, False, {}))


def step(group: contract.Group, backend: str = "auto") -> None:
    """One step of every member by the group's rule, in place; equal bit for bit to
    ``kernels.step_torch.step_group``. ``check`` must have passed for these members."""
    if not group.members:
        return
    rule = rules.RULES[group.rule]
    _check_step_call(group, rule, len(group.slots))
    name = ops.resolve_backend(backend, group.members[0].p.device)
    registry.implementation("step", name, group)(group)


def dense(group: contract.Dense, backend: str = "auto") -> None:
    """The rule on plain fp32 states, in place (``kernels.step_torch.dense_group``, bit for bit)."""
    if not group.params:
        return
    name = ops.resolve_backend(backend, group.params[0].device)
    registry.implementation("dense", name, group)(group)
