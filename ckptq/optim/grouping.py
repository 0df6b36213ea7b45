"""The optimizer's step in groups: parameters sorted once into kernel groups, each group stepped by one
backend call per step (``ckptq.codec.grouped``), with no work per parameter beyond collecting its gradient.

A ``StepPlan`` is built from the parameters that have gradients and their state, and kept while they do
not change: the optimizer rebuilds it after ``add_param_group``, ``load_state_dict`` or new state, and
when the set of parameters with gradients, a group's flags or a gradient's dtype changes. Building
validates every state once (``grouped.check_group``); a step then does, for all parameters at once:
the step counts (one ``_foreach_add_``), the scalars of each (param group, step) pair, the stochastic
rounding seeds, one call per kernel group, and eps' written back into each first moment's dict.

Kernel groups share device, param dtype, code widths, codebooks, block size and flags. Parameters with
plain fp32 moments (below ``min_size``) form dense groups. What the kernels cannot take in place (a
non-contiguous parameter) steps on its own through ``ckptq.optim.adam.step_param``: the reference path,
which gives the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..codec import dtensor, grouped, policy
from ..errors import UsageError
from ..codec.qstate import QState
from ..kernels import contract, memo
from . import adam


@dataclass
class Member:
    """One parameter with a gradient, as the plan steps it."""

    index: int  # its position among all the optimizer's parameters: the stochastic rounding salt
    param: torch.Tensor  # as the optimizer holds it (a Parameter, a DTensor, a complex tensor)
    flat: torch.Tensor  # its local data, real-valued, flat and contiguous: what the kernels update
    state: dict
    group: int  # its param group


def _data(p: torch.Tensor) -> torch.Tensor | None:
    """The param's local data as the kernels update it (a view), or None if it is not contiguous."""
    t = dtensor.local(p).detach()
    t = torch.view_as_real(t) if t.is_complex() else t
    return t.view(-1) if t.is_contiguous() else None


def grad_of(p: torch.Tensor) -> torch.Tensor:
    """The gradient as the kernels read it: local, real-valued, flat, contiguous."""
    g = p.grad
    if g.is_sparse:
        raise UsageError("ckptq's Adam does not support sparse gradients; use torch.optim.SparseAdam")
    g = dtensor.local(g)
    g = torch.view_as_real(g) if g.is_complex() else g
    return g.reshape(-1) if g.is_contiguous() else g.contiguous().view(-1)


def _codebook_key(t: torch.Tensor) -> bytes:
    return memo.by_tensor(lambda q: q.detach().to("cpu", torch.float32).numpy().tobytes(), t)


@dataclass
class KernelGroup:
    """Members stepped by one ``grouped.step_group`` call."""

    members: list[Member]
    moments: tuple  # state keys, in kernel order
    codebooks: tuple  # contract.StepCodebooks per moment
    bits: tuple
    block_size: int
    ratio: bool
    maximize: bool
    seeded: bool  # stochastic rounding (code widths under 8 bits)
    kernel_members: tuple = ()
    cache: dict = field(default_factory=dict)


def _quantized_key(m: Member, amsgrad: bool, maximize: bool) -> tuple:
    """What decides a member's kernel group (and validates its state: QState.from_dict raises)."""
    keys = policy.MOMENT_KEYS[: 3 if amsgrad else 2]
    qs = [QState.from_dict(dtensor.unplace(m.state[k])) for k in keys]
    encode = qs[0].qmap if qs[0].is_ratio else policy.ratio_policy(qs[0].bits).qmap()
    return (m.flat.device, m.flat.dtype, keys, tuple(q.bits for q in qs), qs[0].block_size, qs[0].is_ratio, maximize,
            tuple(_codebook_key(q.qmap) for q in qs), _codebook_key(encode))


def _kernel_group(members: list[Member], key: tuple) -> KernelGroup:
    keys, bits, block_size, ratio, maximize = key[2], key[3], key[4], key[5], key[6]
    first = [QState.from_dict(dtensor.unplace(members[0].state[k])) for k in keys]
    device = members[0].flat.device
    encode = first[0].qmap if ratio else policy.ratio_policy(bits[0]).qmap()
    codebooks = []
    for i, q in enumerate(first):
        enc = (encode if i == 0 else q.qmap).to(device=device, dtype=torch.float32).contiguous()
        codebooks.append(contract.StepCodebooks(q.qmap.to(device=device, dtype=torch.float32).contiguous(),
                                                contract.midpoints(enc).contiguous(), enc))
    kg = KernelGroup(members, keys, tuple(codebooks), bits, block_size, ratio, maximize, seeded=bits[0] < 8)
    kg.kernel_members = tuple(_kernel_member(m, keys) for m in members)
    grouped.check_group(contract.StepGroup(kg.kernel_members, (), torch.empty(0, 10), None, kg.codebooks, bits,
                                           block_size, ratio, maximize, {}))
    return kg


def _kernel_member(m: Member, keys: tuple) -> contract.GroupMember:
    qs = [QState.from_dict(dtensor.unplace(m.state[k])) for k in keys]
    return contract.GroupMember(m.flat, tuple(q.codes.view(-1) for q in qs), tuple(q.absmax.view(-1) for q in qs),
                                qs[0].row_len)


@dataclass
class DenseKernelGroup:
    members: list[Member]
    moments: tuple
    maximize: bool
    cache: dict = field(default_factory=dict)


class StepPlan:
    """The optimizer's parameters with gradients, grouped for the kernels (see the module docstring)."""

    def __init__(self, opt, members: list[Member], signature: tuple):
        self.signature = signature
        self.backend = opt.backend
        self.decoupled = opt.decoupled
        self.groups: list[KernelGroup] = []
        self.dense: list[DenseKernelGroup] = []
        self.single: list[Member] = []
        self._sort(opt, members)
        self.members = [m for m in members if m.flat is not None]
        self.steps = [m.state["step"] for m in self.members]

    def _sort(self, opt, members: list[Member]) -> None:
        quantized: dict[tuple, list[Member]] = {}
        dense: dict[tuple, list[Member]] = {}
        for m in members:
            group = opt.param_groups[m.group]
            amsgrad, maximize = bool(group["amsgrad"]), bool(group["maximize"])
            if m.flat is None:
                self.single.append(m)
            elif isinstance(m.state.get("exp_avg"), dict):
                quantized.setdefault(_quantized_key(m, amsgrad, maximize), []).append(m)
            else:
                keys = policy.MOMENT_KEYS[: 3 if amsgrad else 2]
                dense.setdefault((m.flat.device, m.flat.dtype, keys, maximize), []).append(m)
        self.groups = [_kernel_group(ms, key) for key, ms in quantized.items()]
        self.dense = [DenseKernelGroup(ms, key[2], key[3]) for key, ms in dense.items()]

    def step(self, opt) -> None:
        """One step of every member (their step counts, parameters and states), in place."""
        if self.steps:
            torch._foreach_add_(self.steps, 1.0)
        steps = torch.stack(self.steps).tolist() if self.steps else []
        step_of = {id(m): s for m, s in zip(self.members, steps)}
        scalars: dict[tuple, tuple] = {}
        for kg in self.groups:
            self._step_quantized(opt, kg, step_of, scalars)
        for dg in self.dense:
            self._step_dense(opt, dg, step_of, scalars)
        for m in self.single:
            group = opt.param_groups[m.group]
            p = torch.view_as_real(m.param) if m.param.is_complex() else m.param
            if p is not m.param:
                p.grad = torch.view_as_real(m.param.grad)
            adam.step_param(p, m.state, group, self.decoupled, self.backend, salt=m.index)

    def _scalars(self, opt, group_index: int, step: float, scalars: dict) -> tuple:
        """(hyper row without the decode eps, encode eps) of one (param group, step) pair, computed once."""
        key = (group_index, step)
        if key not in scalars:
            g = opt.param_groups[group_index]
            beta1, beta2 = g["betas"]
            h = adam.hyper_values(g["lr"], beta1, beta2, g["eps"], g["weight_decay"], step, self.decoupled)
            scalars[key] = (h, policy.ratio_eps_for(g, step))
        return scalars[key]

    def _step_quantized(self, opt, kg: KernelGroup, step_of: dict, scalars: dict) -> None:
        rows, steps = [], []
        for m in kg.members:
            step = step_of[id(m)]
            h, enc = self._scalars(opt, m.group, step, scalars)
            exp_avg = m.state["exp_avg"]
            rows.append(h + ((exp_avg["eps"] if kg.ratio else 0.0), enc))
            steps.append(step)
        hyper = torch.tensor(rows, dtype=torch.float32)
        seeds = _seeds(steps, [m.index for m in kg.members]) if kg.seeded else None
        grads = tuple(grad_of(m.param) for m in kg.members)
        grouped.step_group(contract.StepGroup(kg.kernel_members, grads, hyper, seeds, kg.codebooks, kg.bits,
                                              kg.block_size, kg.ratio, kg.maximize, kg.cache), self.backend)
        encode = kg.codebooks[0].encode
        for m, row in zip(kg.members, rows):
            exp_avg = m.state["exp_avg"]
            exp_avg["eps"] = float(row[9])
            if not kg.ratio:
                exp_avg.update(qmap=encode.clone(), transform=policy.RATIO_TRANSFORM, divisor="exp_avg_sq")
        if not kg.ratio:
            opt._step_plan = None  # the first moments are ratios now: another kernel group next step

    def _step_dense(self, opt, dg: DenseKernelGroup, step_of: dict, scalars: dict) -> None:
        rows = [self._scalars(opt, m.group, step_of[id(m)], scalars)[0] + (0.0, 0.0) for m in dg.members]
        moments = tuple(tuple(dtensor.local(m.state[k]).view(-1) for k in dg.moments) for m in dg.members)
        group = contract.DenseGroup(tuple(m.flat for m in dg.members), tuple(grad_of(m.param) for m in dg.members),
                                    moments, torch.tensor(rows, dtype=torch.float32), dg.maximize, dg.cache)
        grouped.dense_group(group, self.backend)


def _seeds(steps: list[float], salts: list[int]) -> torch.Tensor:
    """``ops.step_seed`` of each (step, salt), vectorized: int64 [n] in [0, 2**32)."""
    s = torch.tensor(steps, dtype=torch.float64).to(torch.int64) & 0xFFFFFFFF
    salt = (torch.tensor(salts, dtype=torch.int64) * 0x9E3779B9) & 0xFFFFFFFF
    return contract.mix32(contract.mix32(s) ^ salt)
