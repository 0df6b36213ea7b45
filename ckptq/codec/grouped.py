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
from ..kernels import backend_torch, contract
from ..kernels.contract import DenseGroup, StepGroup, is_flat
from . import ops, policy


def check_group(group: StepGroup) -> None:
    """UsageError unless every member fits the group: its codes and scales laid out for its elements and
    rows at the group's widths and block size, on one device, contiguous; codebooks of 2**bits entries."""
    policy.check_block_size(group.block_size)
    if len(group.codebooks) != len(group.bits) or len(group.bits) not in (2, 3):
        raise UsageError("a step group takes 2 or 3 moments, each with its codebooks and code width")
    for cb, bits in zip(group.codebooks, group.bits):
        ops.check_bits(bits)
        ops.check_codebook(cb.qmap, bits)
        ops.check_codebook(cb.encode, bits)
        if cb.thresholds.shape != (2**bits - 1,) or cb.thresholds.dtype != torch.float32:
            raise UsageError(f"thresholds must be fp32 midpoints of the encode codebook ({2**bits - 1} entries)")
    devices = {m.p.device for m in group.members}
    if len(devices) > 1 or len({m.p.dtype for m in group.members}) > 1:
        raise UsageError("a step group's parameters must share one device and one dtype")
    for i, m in enumerate(group.members):
        n = m.p.numel()
        if not m.p.is_contiguous() or m.p.dim() != 1 or len(m.codes) != len(group.bits) or len(m.absmax) != len(group.bits):
            raise UsageError(f"member {i} of a step group: a flat contiguous param and one codes/scales pair per moment")
        for k, (codes, absmax, bits) in enumerate(zip(m.codes, m.absmax, group.bits)):
            ops.check_quantized(codes, absmax, group.codebooks[k].qmap, group.block_size, bits, n, m.row_len)
            if codes.device != m.p.device or not codes.is_contiguous() or not absmax.is_contiguous() \
                    or absmax.dtype != torch.float32:
                raise UsageError(f"member {i}, moment {k}: contiguous codes and fp32 scales on the param's device")


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
