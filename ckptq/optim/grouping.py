"""The optimizer's step in groups: parameters sorted once into kernel groups, each group stepped by one
backend call per step (``ckptq.codec.grouped``), with no work per parameter beyond collecting its gradient.

A ``StepPlan`` is built from the parameters that have gradients and their state, and kept while they do
not change: the optimizer rebuilds it after ``add_param_group``, ``load_state_dict`` or new state, and
when the set of parameters with gradients, a group's flags or a gradient's dtype changes. Building
validates every state once (``grouped.check_group``); a step then does, for all parameters at once:
the step counts (one ``_foreach_add_``), the scalars of each (param group, step) pair, the stochastic
rounding seeds, one call per kernel group, and eps' written back into each first moment's dict. The
scalars and seeds are computed on the host from the step counts read back once per step, or, for param
groups with ``capturable=True``, on the parameters' device from the step tensors there
(``ckptq.optim.scalars``): the same formula (``adam.rule``), nothing read back.

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
from . import adam, args as optim_args, scalars


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
    seeded: bool  # stochastic rounding (``args.stochastic``: by default code widths under 8 bits)
    kernel_members: tuple = ()
    cache: dict = field(default_factory=dict)
    salt: torch.Tensor | None = None  # host steps: scalars.salt_hash of the members' indices (seeded groups)
    device: scalars.DeviceScalars | None = None  # capturable steps: their scalars on the device


def _quantized_key(m: Member, amsgrad: bool, maximize: bool, capturable: bool, rounding: str = "auto") -> tuple:
    """What decides a member's kernel group (and validates its state: QState.from_dict raises); the last
    entry: whether its moments round stochastically (``args.stochastic``)."""
    keys = policy.MOMENT_KEYS[: 3 if amsgrad else 2]
    qs = [QState.from_dict(dtensor.unplace(m.state[k])) for k in keys]
    encode = qs[0].qmap if qs[0].is_ratio else policy.ratio_policy(qs[0].bits).qmap()
    return (m.flat.device, m.flat.dtype, keys, tuple(q.bits for q in qs), qs[0].block_size, qs[0].is_ratio, maximize,
            capturable, tuple(_codebook_key(q.qmap) for q in qs), _codebook_key(encode),
            optim_args.stochastic(rounding, qs[0].bits))


def _kernel_group(members: list[Member], key: tuple) -> KernelGroup:
    device, keys, bits, block_size, ratio, maximize, capturable = key[0], *key[2:8]
    first = [QState.from_dict(dtensor.unplace(members[0].state[k])) for k in keys]
    encode = first[0].qmap if ratio else policy.ratio_policy(bits[0]).qmap()
    codebooks = tuple(_shared_codebooks(q.qmap, encode if i == 0 else q.qmap, device) for i, q in enumerate(first))
    kg = KernelGroup(members, keys, codebooks, bits, block_size, ratio, maximize, seeded=key[-1])
    kg.kernel_members = tuple(_kernel_member(m, keys) for m in members)
    grouped.check_group(contract.StepGroup(kg.kernel_members, (), torch.empty(0, 10), None, kg.codebooks, bits,
                                           block_size, ratio, maximize, {}))
    salts = [m.index for m in members] if kg.seeded else None
    if capturable:
        kg.device = scalars.DeviceScalars([m.state for m in members], [m.group for m in members], device, salts, ratio)
    elif salts is not None:
        kg.salt = scalars.salt_hash(salts, "cpu")
    return kg


_SHARED: dict[tuple, contract.StepCodebooks] = {}  # codebooks by their values and device, across plans


def _shared_codebooks(qmap: torch.Tensor, encode: torch.Tensor, device: torch.device) -> contract.StepCodebooks:
    """One moment's codebooks (copies, fp32 on ``device``), the same tensors for the same values in every
    plan: what the backends derive from them (code tables, search trees, step configs, by tensor) is then
    computed once, not again at the first step after each rebuild (a first step's host reads)."""
    key = (_codebook_key(qmap), _codebook_key(encode), device)
    if key not in _SHARED:
        if len(_SHARED) >= 64:
            _SHARED.clear()
        enc = encode.detach().to(device=device, dtype=torch.float32, copy=True).contiguous()
        _SHARED[key] = contract.StepCodebooks(qmap.detach().to(device=device, dtype=torch.float32, copy=True)
                                              .contiguous(), contract.midpoints(enc).contiguous(), enc)
    return _SHARED[key]


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
    device: scalars.DeviceScalars | None = None  # capturable steps: their scalars on the device


def _dense_group(members: list[Member], key: tuple) -> DenseKernelGroup:
    device, _, moments, maximize, capturable = key
    on_device = scalars.DeviceScalars([m.state for m in members], [m.group for m in members], device, None,
                                      False) if capturable else None
    return DenseKernelGroup(members, moments, maximize, device=on_device)


class StepPlan:
    """The optimizer's parameters with gradients, grouped for the kernels (see the module docstring)."""

    def __init__(self, opt, members: list[Member], signature: tuple):
        self.signature = signature
        self.backend = opt.backend
        self.decoupled = opt.decoupled
        self.rule = adam.rule(opt.decoupled)
        self.groups: list[KernelGroup] = []
        self.dense: list[DenseKernelGroup] = []
        self.single: list[Member] = []
        self._sort(opt, members)
        self.members = [m for m in members if m.flat is not None]  # their steps are on the device when capturable
        self.steps = [m.state["step"] for m in self.members]
        self.host = [m for m in self.members if not opt.param_groups[m.group]["capturable"]]
        self.host_steps = [m.state["step"] for m in self.host]  # read on the host at every step
        self.capturable = len(self.host) < len(self.members)

    def _sort(self, opt, members: list[Member]) -> None:
        quantized: dict[tuple, list[Member]] = {}
        dense: dict[tuple, list[Member]] = {}
        for m in members:
            group = opt.param_groups[m.group]
            amsgrad, maximize, capturable = bool(group["amsgrad"]), bool(group["maximize"]), bool(group["capturable"])
            if m.flat is None:
                self.single.append(m)
            elif isinstance(m.state.get("exp_avg"), dict):
                key = _quantized_key(m, amsgrad, maximize, capturable, opt.rounding)
                quantized.setdefault(key, []).append(m)
            else:
                keys = policy.MOMENT_KEYS[: 3 if amsgrad else 2]
                dense.setdefault((m.flat.device, m.flat.dtype, keys, maximize, capturable), []).append(m)
        self.groups = [_kernel_group(ms, key) for key, ms in quantized.items()]
        self.dense = [_dense_group(ms, key) for key, ms in dense.items()]

    def step(self, opt) -> None:
        """One step of every member (their step counts, parameters and states), in place. Where the first
        moments became ratios the plan is rebuilt at once when capturable, so that the steps after the
        first change nothing on the host (and can be captured in a CUDA graph)."""
        if self.steps:
            torch._foreach_add_(self.steps, 1.0)
        steps = torch.stack(self.host_steps).tolist() if self.host_steps else []
        step_of = {id(m): s for m, s in zip(self.host, steps)}
        computed: dict[tuple, tuple] = {}
        for kg in self.groups:
            self._step_quantized(opt, kg, step_of, computed)
        for dg in self.dense:
            self._step_dense(opt, dg, step_of, computed)
        for m in self.single:
            group = opt.param_groups[m.group]
            p = torch.view_as_real(m.param) if m.param.is_complex() else m.param
            if p is not m.param:
                p.grad = torch.view_as_real(m.param.grad)
            adam.step_param(p, m.state, group, self.decoupled, self.backend, salt=m.index,
                            rounding=opt.rounding)
        if self.capturable and opt._step_plan is None:
            opt._step_plan_now()

    def _scalars(self, opt, group_index: int, step: float, computed: dict) -> tuple:
        """(hyper row without the decode eps, encode eps) of one (param group, step) pair, computed once."""
        key = (group_index, step)
        if key not in computed:
            g = opt.param_groups[group_index]
            beta1, beta2 = g["betas"]
            h = adam.hyper_values(g["lr"], beta1, beta2, g["eps"], g["weight_decay"], step, self.decoupled)
            computed[key] = (h, policy.ratio_eps_for(g, step))
        return computed[key]

    def _hyper(self, opt, kg: KernelGroup, step_of: dict, computed: dict) -> tuple:
        """(hyper fp32 [n, 10], seeds or None, the encode eps of each member (floats or float64 [n]))."""
        if kg.device is not None:
            hyper, fields, step = kg.device.hyper(opt.param_groups, self.rule)
            return hyper, kg.device.seeds(step) if kg.seeded else None, fields["encode_eps"]
        rows, steps = [], []
        for m in kg.members:
            step = step_of[id(m)]
            h, enc = self._scalars(opt, m.group, step, computed)
            rows.append(h + ((m.state["exp_avg"]["eps"] if kg.ratio else 0.0), enc))
            steps.append(step)
        seeds = None
        if kg.seeded:
            seeds = scalars.seeds(torch.tensor(steps, dtype=torch.float64).to(torch.int64), kg.salt)
        return torch.tensor(rows, dtype=torch.float32), seeds, [row[9] for row in rows]

    def _step_quantized(self, opt, kg: KernelGroup, step_of: dict, computed: dict) -> None:
        hyper, seeds, encode_eps = self._hyper(opt, kg, step_of, computed)
        grads = tuple(grad_of(m.param) for m in kg.members)
        grouped.step_group(contract.StepGroup(kg.kernel_members, grads, hyper, seeds, kg.codebooks, kg.bits,
                                              kg.block_size, kg.ratio, kg.maximize, kg.cache), self.backend)
        if kg.device is not None:
            kg.device.written_with(encode_eps)
        else:
            for m, eps in zip(kg.members, encode_eps):
                m.state["exp_avg"]["eps"] = float(eps)
        if not kg.ratio:
            encode = kg.codebooks[0].encode
            for m in kg.members:
                m.state["exp_avg"].update(qmap=encode.clone(), transform=policy.RATIO_TRANSFORM, divisor="exp_avg_sq")
            opt._step_plan = None  # the first moments are ratios now: another kernel group next step

    def _step_dense(self, opt, dg: DenseKernelGroup, step_of: dict, computed: dict) -> None:
        if dg.device is not None:
            hyper = dg.device.hyper(opt.param_groups, self.rule)[0]
        else:
            rows = [self._scalars(opt, m.group, step_of[id(m)], computed)[0] + (0.0, 0.0) for m in dg.members]
            hyper = torch.tensor(rows, dtype=torch.float32)
        moments = tuple(tuple(dtensor.local(m.state[k]).view(-1) for k in dg.moments) for m in dg.members)
        group = contract.DenseGroup(tuple(m.flat for m in dg.members), tuple(grad_of(m.param) for m in dg.members),
                                    moments, hyper, dg.maximize, dg.cache)
        grouped.dense_group(group, self.backend)
