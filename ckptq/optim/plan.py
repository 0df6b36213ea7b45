"""The engine's step in groups: the parameters with gradients sorted once into kernel groups, each stepped
by one backend call per step (``ckptq.codec.grouped``: C on the CPU, one Triton launch on CUDA, the PyTorch
reference elsewhere), for every optimizer alike: a group is its rule (``ckptq.kernels.rules``), its flag
word and its state slots.

A ``StepPlan`` is built from the parameters that have gradients and their state, and kept while they do
not change: the optimizer rebuilds it after ``add_param_group``, ``load_state_dict`` or new state, and when
the set of parameters with gradients, a group's flags or a gradient's dtype changes. Building validates
every state once (``grouped.check``); a step then does, for all parameters at once: the step counts (one
``_foreach_add_``), the scalars of each (param group, step) pair, the stochastic rounding seeds, one call
per kernel group, and eps' written back into each ratio state's dict. The scalars and seeds are computed on
the host from the step counts read back once per step, or, for param groups with ``capturable=True``, on
the parameters' device from the step tensors there (``ckptq.optim.scalars``): the same formula, nothing
read back.

Kernel groups share device, dtypes, code widths, codebooks, transforms, block size and flags. Parameters
with plain fp32 states (below ``min_size``) form dense groups. A parameter the kernels cannot update in
place (not contiguous) is stepped through a contiguous copy, refreshed from it before every step and written
back after (the parameter may change between steps: Muon's update, a loaded checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..codec import dtensor, grouped
from ..codec.qstate import QState
from ..kernels import contract, memo, rules
from . import scalars
from .args import stochastic


@dataclass
class Member:
    """One parameter with a gradient, as the plan steps it."""

    index: int  # its position among all the optimizer's parameters: the stochastic rounding salt
    param: torch.Tensor  # as the optimizer holds it (a Parameter, a DTensor, a complex tensor)
    flat: torch.Tensor  # its local data, real-valued, flat, contiguous: a copy where the param is not contiguous
    target: torch.Tensor | None  # where the param is not contiguous: its real-valued data, written from ``flat``
    state: dict
    group: int  # its param group
    keys: tuple  # its state keys, in kernel order
    fresh: bool = False  # its state was created for this step


def data_of(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the param's local data as the kernels update it, flat; where that is a contiguous copy, the data to
    write it back to after the step)."""
    t = dtensor.local(p).detach()
    t = torch.view_as_real(t) if t.is_complex() else t
    return (t.view(-1), None) if t.is_contiguous() else (t.contiguous().view(-1), t)


def grad_of(p: torch.Tensor) -> torch.Tensor:
    """The gradient as the kernels read it: local, real-valued, flat, contiguous."""
    g = dtensor.local(p.grad)
    g = torch.view_as_real(g) if g.is_complex() else g
    return g.reshape(-1) if g.is_contiguous() else g.contiguous().view(-1)


def _codebook_key(t: torch.Tensor) -> bytes:
    return memo.by_tensor(lambda q: q.detach().to("cpu", torch.float32).numpy().tobytes(), t)


_SHARED: dict[tuple, tuple] = {}  # codebooks by their values and device, across plans


def _shared(qmap: torch.Tensor, encode: torch.Tensor, device) -> tuple:
    """(qmap, thresholds, encode) as fp32 copies on ``device``, the same tensors for the same values in every
    plan, so what the backends derive from them (code tables, search trees, configs) is computed once."""
    key = (_codebook_key(qmap), _codebook_key(encode), device)
    if key not in _SHARED:
        if len(_SHARED) >= 64:
            _SHARED.clear()
        enc = encode.detach().to(device=device, dtype=torch.float32, copy=True).contiguous()
        _SHARED[key] = (qmap.detach().to(device=device, dtype=torch.float32, copy=True).contiguous(),
                        contract.midpoints(enc).contiguous(), enc)
    return _SHARED[key]


@dataclass
class KernelGroup:
    """Members stepped by one ``grouped.step`` call."""

    members: list[Member]
    keys: tuple  # state keys, in kernel order
    slots: tuple  # contract.Slot per key
    block_size: int
    flags: int
    seeded: bool
    relabel: tuple  # keys whose codes become ratios in this step: the plan is rebuilt after it
    kernel_members: tuple = ()
    cache: dict = field(default_factory=dict)
    salt: torch.Tensor | None = None  # host steps: scalars.salt_hash of the members' indices (seeded groups)
    device: scalars.DeviceScalars | None = None  # capturable steps: their scalars on the device


@dataclass
class DenseGroup:
    members: list[Member]
    keys: tuple
    flags: int
    cache: dict = field(default_factory=dict)
    device: scalars.DeviceScalars | None = None


def _slots_of(m: Member, opt, device) -> tuple[tuple, int, tuple]:
    """(slots, block size, relabelled keys) of a member's qstates: each decoded by its stored transform,
    encoded by the declared one (a plain first moment of an older file is written back as a ratio)."""
    declared = {s.key: s for s in opt._declared(opt.param_groups[m.group])}
    qs = [QState.from_dict(dtensor.unplace(m.state[k])) for k in m.keys]
    slots, relabel = [], []
    for k, q in zip(m.keys, qs):
        s = declared[k]
        stored = contract.TRANSFORM_NAMES[q.transform]
        encode = q.qmap if stored == s.kernel_transform else opt._codebook(s).to(q.qmap.device)
        if stored != s.kernel_transform:
            relabel.append(k)
        qmap, thresholds, enc = _shared(q.qmap, encode, device)
        divisor = m.keys.index(s.divisor) if s.divisor else -1
        slots.append(contract.Slot(qmap, thresholds, enc, q.bits, stored, s.kernel_transform, divisor, s.seeded))
    return tuple(slots), qs[0].block_size, tuple(relabel)


def _quantized_key(m: Member, opt, capturable: bool) -> tuple:
    """What decides a member's kernel group (and validates its state: QState.from_dict raises)."""
    slots, block, relabel = _slots_of(m, opt, m.flat.device)
    group = opt.param_groups[m.group]
    codebooks = tuple((_codebook_key(s.qmap), _codebook_key(s.encode)) for s in slots)
    shape = tuple((s.bits, s.decode, s.encode_as, s.divisor, s.seeded) for s in slots)
    return (m.flat.device, m.flat.dtype, m.param.grad.dtype, m.keys, shape, codebooks, block, opt._rule_flags(group),
            capturable, stochastic(opt.rounding, slots[0].bits), relabel)


def _kernel_group(opt, members: list[Member], key: tuple) -> KernelGroup:
    device, flags, capturable, seeded, relabel = key[0], key[7], key[8], key[9], key[10]
    slots, block, _ = _slots_of(members[0], opt, device)
    kg = KernelGroup(members, members[0].keys, slots, block, flags, seeded, relabel)
    kg.kernel_members = tuple(_kernel_member(m) for m in members)
    rule = opt.RULE
    grouped.check(contract.Group(rule.name, flags, kg.kernel_members, (), (), torch.empty(0, len(rule.fields)), None,
                                 slots, block, {}))
    salts = [m.index for m in members] if seeded else None
    if capturable:
        kg.device = scalars.DeviceScalars([m.state for m in members], [m.group for m in members], device, salts,
                                          _ratio_key(kg))
    elif salts is not None:
        kg.salt = scalars.salt_hash(salts, "cpu")
    return kg


def _ratio_key(kg: KernelGroup) -> str | None:
    """The state key whose dict holds the decode eps' (the first slot stored as a ratio), if any."""
    return next((k for k, s in zip(kg.keys, kg.slots) if s.decode == contract.RATIO), None)


def _kernel_member(m: Member) -> contract.GroupMember:
    qs = [QState.from_dict(dtensor.unplace(m.state[k])) for k in m.keys]
    return contract.GroupMember(m.flat, tuple(q.codes.view(-1) for q in qs), tuple(q.absmax.view(-1) for q in qs),
                                qs[0].row_len)


class StepPlan:
    """The optimizer's parameters with gradients, grouped for the kernels (see the module docstring)."""

    def __init__(self, opt, members: list[Member], signature: tuple):
        self.signature = signature
        self.backend = opt.backend
        self.rule = opt.RULE
        self.groups: list[KernelGroup] = []
        self.dense: list[DenseGroup] = []
        quantized: dict[tuple, list[Member]] = {}
        dense: dict[tuple, list[Member]] = {}
        for m in members:
            group = opt.param_groups[m.group]
            capturable = bool(group.get("capturable", False))
            if isinstance(m.state.get(m.keys[0]), dict):
                quantized.setdefault(_quantized_key(m, opt, capturable), []).append(m)
            else:
                key = (m.flat.device, m.flat.dtype, m.param.grad.dtype, m.keys, opt._rule_flags(group), capturable)
                dense.setdefault(key, []).append(m)
        self.groups = [_kernel_group(opt, ms, key) for key, ms in quantized.items()]
        for key, ms in dense.items():
            on_device = scalars.DeviceScalars([m.state for m in ms], [m.group for m in ms], key[0], None, None) \
                if key[5] else None
            self.dense.append(DenseGroup(ms, key[3], key[4], device=on_device))
        self.members = members
        self.steps = [m.state["step"] for m in members]
        self.host = [m for m in members if not opt.param_groups[m.group].get("capturable", False)]
        self.host_steps = [m.state["step"] for m in self.host]  # read on the host at every step
        self.capturable = len(self.host) < len(members)
        self.fresh = {id(m) for m in members if m.fresh}
        self.copied = [m for m in members if m.target is not None]  # stepped through a contiguous copy

    def step(self, opt) -> dict:
        """One step of every member (step counts, parameters, states), in place; returns the directions of a
        rule that writes them ({id(param): fp32 [n]}). Where states were relabelled the plan is rebuilt at
        once when capturable, so that the steps after the first change nothing on the host."""
        if self.steps:
            torch._foreach_add_(self.steps, 1.0)
        for m in self.copied:  # the parameter as it is now (changed since the last step: Muon's update, a load)
            m.flat.view(m.target.shape).copy_(m.target)
        steps = torch.stack(self.host_steps).tolist() if self.host_steps else []
        step_of = {id(m): s for m, s in zip(self.host, steps)}
        computed: dict[tuple, dict] = {}
        directions: dict[int, torch.Tensor] = {}
        for kg in self.groups:
            directions.update(self._step_quantized(opt, kg, step_of, computed))
        for dg in self.dense:
            directions.update(self._step_dense(opt, dg, step_of, computed))
        for m in self.copied:
            m.target.copy_(m.flat.view(m.target.shape))
        for m in self.members:
            m.fresh = False
        self.fresh = set()
        if self.capturable and opt._step_plan is None:
            opt._plan_now()
        return directions

    def _fields(self, opt, group_index: int, step: float, fresh: bool, extra: tuple, computed: dict) -> dict:
        """The scalars of one (param group, step, fresh, scalar states) key by field name, computed once."""
        key = (group_index, step, fresh, extra)
        if key not in computed:
            computed[key] = opt._formula_of(opt.param_groups[group_index], step, fresh, extra)
        return computed[key]

    def _rows(self, opt, members: list[Member], step_of: dict, computed: dict, ratio_key) -> tuple:
        fields, extra_keys = self.rule.fields, tuple(opt.SCALAR_STATES)
        rows, steps = [], []
        for m in members:
            step = step_of[id(m)]
            extra = tuple(float(m.state[k]) for k in extra_keys)
            values = dict(self._fields(opt, m.group, step, id(m) in self.fresh, extra, computed))
            for k in extra_keys:  # the scalar states' new values (the formula's, fp32 as torch keeps them)
                m.state[k].fill_(values[k])
            values["decode_eps"] = m.state[ratio_key]["eps"] if ratio_key else 0.0
            rows.append(tuple(values.get(name, 0.0) for name in fields))
            steps.append(step)
        return rows, steps

    def _hyper(self, opt, kg, step_of: dict, computed: dict, ratio_key) -> tuple:
        """(hyper fp32 [n, F], seeds or None, the encode eps of each member (floats or float64 [n]) or None)."""
        fields = self.rule.fields
        enc = fields.index("encode_eps") if "encode_eps" in fields else None
        if kg.device is not None:
            fresh = [id(m) in self.fresh for m in kg.members] if self.fresh else None
            hyper, named, step = kg.device.hyper(opt, fields, fresh)
            seeds = kg.device.seeds(step) if getattr(kg, "seeded", False) else None
            return hyper, seeds, named.get("encode_eps")
        rows, steps = self._rows(opt, kg.members, step_of, computed, ratio_key)
        seeds = None
        if getattr(kg, "seeded", False):
            seeds = scalars.seeds(torch.tensor(steps, dtype=torch.float64).to(torch.int64), kg.salt)
        return torch.tensor(rows, dtype=torch.float32), seeds, None if enc is None else [row[enc] for row in rows]

    def _outs(self, members: list[Member], flags: int) -> tuple:
        if not rules.writes_direction(self.rule, flags):
            return ()
        sizes = [m.flat.numel() for m in members]
        return torch.empty(sum(sizes), dtype=torch.float32, device=members[0].flat.device).split(sizes)

    def _step_quantized(self, opt, kg: KernelGroup, step_of: dict, computed: dict) -> dict:
        ratio_key = _ratio_key(kg)
        hyper, seeds, encode_eps = self._hyper(opt, kg, step_of, computed, ratio_key)
        outs = self._outs(kg.members, kg.flags)
        grads = tuple(grad_of(m.param) for m in kg.members)
        grouped.step(contract.Group(self.rule.name, kg.flags, kg.kernel_members, grads, outs, hyper, seeds, kg.slots,
                                    kg.block_size, kg.cache), self.backend)
        if kg.relabel:
            for k in kg.relabel:
                slot = kg.slots[kg.keys.index(k)]
                declared = {s.key: s for s in opt._declared(opt.param_groups[kg.members[0].group])}[k]
                for m in kg.members:
                    m.state[k].update(qmap=slot.encode.clone(), transform=declared.transform)
                    if declared.divisor:
                        m.state[k]["divisor"] = declared.divisor
            opt._step_plan = None  # the states' transforms changed: another kernel group next step
        ratio_keys = [k for k, s in zip(kg.keys, kg.slots) if s.encode_as == contract.RATIO]
        if ratio_keys and kg.device is not None:
            kg.device.written_with(encode_eps)
        elif ratio_keys:
            for m, eps in zip(kg.members, encode_eps):
                for k in ratio_keys:
                    m.state[k]["eps"] = float(eps)
        return {id(m.param): out for m, out in zip(kg.members, outs)}

    def _step_dense(self, opt, dg: DenseGroup, step_of: dict, computed: dict) -> dict:
        hyper = self._hyper(opt, dg, step_of, computed, None)[0]
        states = tuple(tuple(dtensor.local(m.state[k]).view(-1) for k in dg.keys) for m in dg.members)
        outs = self._outs(dg.members, dg.flags)
        group = contract.Dense(self.rule.name, dg.flags, tuple(m.flat for m in dg.members),
                               tuple(grad_of(m.param) for m in dg.members), states, outs, hyper, dg.cache)
        grouped.dense(group, self.backend)
        return {id(m.param): out for m, out in zip(dg.members, outs)}
