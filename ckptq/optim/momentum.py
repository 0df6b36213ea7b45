"""8-bit and 4-bit SGD, Lion and Muon: optimizers with one signed state per parameter, kept blockwise
quantized in the form ``ckptq convert`` writes (role ``first``: ``ckptq.codec.roles``; codebooks by
``ckptq.codec.policy.ROLE_POLICIES``), with their torch counterpart's arguments and state keys.

- ``SGD8bit`` is ``torch.optim.SGD`` (momentum, dampening, nesterov, weight_decay, maximize): its
  ``momentum_buffer`` low-bit. With momentum 0 it keeps no state, as torch's.
- ``Lion8bit`` is lion-pytorch's ``Lion`` (and bitsandbytes' ``Lion8bit``): ``exp_avg`` low-bit,
  the update sign(beta1 * m + (1 - beta1) * g), decoupled weight decay.
- ``Muon8bit`` is ``torch.optim.Muon`` (2-D parameters; momentum, nesterov, Newton-Schulz in torch, as torch's,
  in bfloat16): ``momentum_buffer`` low-bit.

The elementwise part of every step (the state's update, the direction, and for SGD and Lion the parameter's
update) is one grouped kernel call per param group and layout (``ckptq.codec.grouped.momentum_group``: C on the
CPU, Triton on CUDA, the PyTorch reference elsewhere, equal bit for bit). The state is requantized at every
step: rounded to nearest at 8 bits, stochastically below (seeded by the step count and the parameter's
index, so a resumed run draws the same numbers). Parameters under ``min_size`` elements keep fp32 state and
the same math. Each parameter's state also holds ``step`` (a 0-dim fp32 tensor, as torch's Adam), which
torch's SGD and Muon ignore when they load an expanded state dict.
"""

from __future__ import annotations

import math

import torch

from ..codec import dtensor, grouped, ops, qstate, quant, roles
from ..codec.qstate import QState
from ..errors import ArgumentError, UsageError
from ..kernels import contract, momentum_torch
from . import args as optim_args, momentum_io
from .surface import LowBitOptimizer

OPTIONS = {"block_size": 256, "min_size": 4096, "backend": "auto", "bits": 8, "rounding": "auto"}


class _OneState(LowBitOptimizer):
    """What SGD8bit, Lion8bit and Muon8bit share: the low-bit state, the grouped step, state dicts."""

    OPTIONS = OPTIONS

    state_key = "momentum_buffer"
    update = contract.UPDATE_LINEAR

    def __init__(self, params, defaults: dict, block_size, min_size, backend, bits, rounding="auto"):
        self.block_size = optim_args.check_options(block_size, min_size, backend, bits)
        self.min_size, self.backend, self.bits = int(min_size), backend, bits
        self.rounding = optim_args.check_rounding(rounding)
        super().__init__(params, defaults)

    # what each optimizer defines

    def _check_group(self, group: dict, where: str) -> None:
        raise NotImplementedError

    def _coefficients(self, group: dict, fresh: bool) -> tuple:
        """The step's scalars (``contract.MOMENTUM_FIELDS``) for a parameter of ``group``; ``fresh``: its state
        was created for this step."""
        raise NotImplementedError

    def _has_state(self, group: dict) -> bool:
        return True

    def _apply(self, group: dict, params: list, directions: list) -> None:
        """Apply directions d (UPDATE_NONE optimizers: Muon) to their parameters."""

    def _import(self, state_dict) -> tuple[dict, list]:
        """This optimizer's own state dict, its torch counterpart's (fp32 state, quantized here as ``ckptq convert``
        does), ``ckptq.load(path)["optimizer"]`` (low-bit state used as stored where its width and layout fit,
        else requantized) or a bitsandbytes one-state optimizer's (decoded first): ``momentum_io``."""
        return momentum_io.import_state_dict(self, state_dict)

    # state

    def _state_changed(self) -> None:
        self._members, self._groups = {}, {}

    def quantized(self, p: torch.Tensor) -> bool:
        """Low-bit state from ``min_size`` elements; a DTensor's where its rows follow its shards."""
        return p.numel() >= self.min_size and (not dtensor.is_dtensor(p) or dtensor.shardable(p))

    def quantize(self, t: torch.Tensor) -> dict:
        """fp32 state (a tensor, or a DTensor placed like its parameter) -> this optimizer's qstate."""
        q = quant.quantize_state(dtensor.local(t).float(), self.state_key, self.block_size, bits=self.bits,
                                 role=roles.FIRST)
        q["dtype"] = "float32"
        return dtensor.place(q, t) if dtensor.is_dtensor(t) else q

    def _new_state(self, p: torch.Tensor) -> dict:
        zeros = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        return {"step": torch.tensor(0.0), self.state_key: self.quantize(zeros) if self.quantized(p) else zeros}

    def _member(self, index: int, p: torch.Tensor) -> tuple:
        """(the kernels' view of a quantized parameter, its QState, its codebook's bytes), kept until the state
        changes."""
        key = id(p)
        if key not in self._members:
            q = QState.from_dict(dtensor.unplace(self.state[p][self.state_key]))
            flat = dtensor.local(p).detach()
            if not flat.is_contiguous():
                raise UsageError(f"parameter {index} of {type(self).__name__} is not contiguous; make it contiguous "
                                 "(the step updates it in place)")
            self._members[key] = (contract.GroupMember(flat.view(-1), (q.codes.view(-1),), (q.absmax.view(-1),),
                                                       q.row_len), q, _codebook(q.qmap))
        return self._members[key]

    # the step

    def _step(self) -> None:
        index = 0
        for group in self.param_groups:
            active = []
            for p in group["params"]:
                if p.grad is not None:
                    active.append((index, p))
                index += 1
            if active:
                self._step_group(group, active)

    def _step_group(self, group: dict, active: list) -> None:
        for _, p in active:
            _check_param(self, p)
        if not self._has_state(group):
            _plain_step(group, [p for _, p in active])
            return
        fresh = set()
        for _, p in active:
            if not self.state[p]:
                self.state[p].update(self._new_state(p))
                self._state_changed()
                fresh.add(id(p))
            self.state[p]["step"] += 1
        buckets: dict[tuple, list] = {}
        dense = []
        for i, p in active:
            if qstate.is_qstate(self.state[p][self.state_key]):
                member, q, codebook = self._member(i, p)
                key = (member.p.device, member.p.dtype, p.grad.dtype, q.bits, q.block_size, codebook)
                buckets.setdefault(key, []).append((i, p, member, q))
            else:
                dense.append(p)
        directions = {}
        for key, members in buckets.items():
            directions.update(self._step_quantized(group, key, members, fresh))
        for p in dense:
            directions[id(p)] = self._step_dense(group, p, id(p) in fresh)
        if self.update == contract.UPDATE_NONE:
            params = [p for _, p in active]
            self._apply(group, params, [directions[id(p)] for p in params])

    def _kernel_group(self, group: dict, key: tuple, members: list) -> contract.MomentumGroup:
        """The members' group as the kernels take it, without this step's gradients and scalars: built and checked
        once (``grouped.check_momentum_group``), then kept with its codebooks and the backend's cache (pointer
        tables, launch plans) until the state or the set of parameters with gradients changes."""
        maximize = bool(group.get("maximize", False))
        ids = (key, maximize, tuple(id(p) for _, p, _, _ in members))
        if ids not in self._groups:
            q0 = members[0][3]
            encode = q0.qmap.to(members[0][2].p.device, torch.float32).contiguous()
            codebooks = contract.StepCodebooks(encode, contract.midpoints(encode).contiguous(), encode)
            kernel_group = contract.MomentumGroup(tuple(m for _, _, m, _ in members), (), (),
                                                  torch.empty(0, len(contract.MOMENTUM_FIELDS)), None, codebooks,
                                                  q0.bits, q0.block_size, maximize, self.update, {})
            grouped.check_momentum_group(kernel_group)
            self._groups[ids] = kernel_group
        return self._groups[ids]

    def _step_quantized(self, group: dict, key: tuple, members: list, fresh: set) -> dict:
        kernel_group = self._kernel_group(group, key, members)
        rows = [self._coefficients(group, id(p) in fresh) for _, p, _, _ in members]
        seeds = None
        if optim_args.stochastic(self.rounding, kernel_group.bits):
            seeds = torch.tensor([ops.step_seed(int(self.state[p]["step"]), i) for i, p, _, _ in members])
        grads = tuple(_flat_grad(p) for _, p, _, _ in members)
        outs = ()
        if self.update == contract.UPDATE_NONE:
            sizes = [m.p.numel() for m in kernel_group.members]
            outs = tuple(torch.empty(sum(sizes), dtype=torch.float32, device=kernel_group.members[0].p.device)
                         .split(sizes))
        grouped.momentum_group(kernel_group._replace(grads=grads, outs=outs, seeds=seeds,
                                                     hyper=torch.tensor(rows, dtype=torch.float32)), self.backend)
        return {id(p): out for (_, p, _, _), out in zip(members, outs)}

    def _step_dense(self, group: dict, p: torch.Tensor, fresh: bool):
        """A parameter with fp32 state: the same math in PyTorch (``momentum_torch.momentum_math``)."""
        h = torch.tensor(self._coefficients(group, fresh), dtype=torch.float32, device=dtensor.local(p).device)
        data, state = dtensor.local(p).detach(), dtensor.local(self.state[p][self.state_key])
        grad = dtensor.local(p.grad)
        new_p, m_new, d = momentum_torch.momentum_math(data.float(), grad.float(), state, h,
                                                      bool(group.get("maximize", False)), self.update)
        state.copy_(m_new)
        if new_p is not None:
            data.copy_(new_p)
        return d.reshape(-1)


def _codebook(qmap: torch.Tensor) -> bytes:
    return qmap.detach().to("cpu", torch.float32).numpy().tobytes()


def _flat_grad(p: torch.Tensor) -> torch.Tensor:
    g = dtensor.local(p.grad)
    return g.reshape(-1) if g.is_contiguous() else g.contiguous().view(-1)


def _check_param(opt, p: torch.Tensor) -> None:
    if p.grad.is_sparse:
        raise UsageError(f"{type(opt).__name__} does not support sparse gradients")
    if p.is_complex():
        raise UsageError(f"{type(opt).__name__} does not support complex parameters")
    if p.is_meta or p.grad.is_meta:
        raise UsageError(f"a parameter of shape {tuple(p.shape)} or its gradient is on the meta device; materialize "
                         "the model (module.to_empty(device=...)) before stepping")


def _plain_step(group: dict, params: list) -> None:
    """SGD without momentum: no state, torch's update (p -= lr * (g + wd * p))."""
    for p in params:
        g = -p.grad if group["maximize"] else p.grad
        if group["weight_decay"]:
            g = g.add(p, alpha=group["weight_decay"])
        p.add_(g, alpha=-group["lr"])


def _number(x, name: str, low: float = 0.0, high: float = math.inf, closed: bool = True) -> float:
    value = optim_args._scalar(x, name)
    if not (low <= value <= high if closed else low <= value < high) or math.isnan(value):
        raise ArgumentError(f"Invalid {name}: {x} (must lie in [{low}, {high}{']' if closed else ')'})")
    if value == math.inf:
        raise ArgumentError(f"Invalid {name}: inf (must be finite)")
    return value


class SGD8bit(_OneState):
    """``torch.optim.SGD`` with a blockwise 8-bit (``bits=4``: 4-bit) ``momentum_buffer``."""

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 maximize=False, foreach=None, differentiable=False, fused=None, block_size=None, min_size=4096,
                 backend="auto", bits=8, rounding="auto"):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        maximize=maximize, foreach=foreach, differentiable=differentiable, fused=fused)
        self._check_group(defaults, "the arguments")
        super().__init__(params, defaults, block_size, min_size, backend, bits, rounding)

    def _check_group(self, group: dict, where: str) -> None:
        try:
            _number(group["lr"], "learning rate")
            _number(group["momentum"], "momentum value")
            _number(group["dampening"], "dampening value", high=1.0)
            _number(group["weight_decay"], "weight_decay value")
            if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
                raise ArgumentError("Nesterov momentum requires a momentum and zero dampening")
            optim_args.check_flags(group)
        except (ArgumentError, KeyError) as e:
            raise ArgumentError(f"{where}: {e}") from None

    def _has_state(self, group: dict) -> bool:
        return group["momentum"] != 0

    def _coefficients(self, group: dict, fresh: bool) -> tuple:
        mom = group["momentum"]
        keep, take = (0.0, 1.0) if fresh else (mom, 1.0 - group["dampening"])  # torch: buf = g at the first step
        c_new, c_grad = (mom, 1.0) if group["nesterov"] else (1.0, 0.0)
        return (group["weight_decay"], keep, take, 0.0, c_new, c_grad, 1.0, -group["lr"])


class Lion8bit(_OneState):
    """lion-pytorch's ``Lion`` (bitsandbytes' ``Lion8bit``) with a blockwise 8-bit (``bits=4``: 4-bit)
    ``exp_avg``: p <- p * (1 - lr * wd) - lr * sign(beta1 * m + (1 - beta1) * g), m <- beta2 * m + (1 - beta2) * g.
    ``decoupled_weight_decay=True`` divides weight_decay by the initial lr, as lion-pytorch does."""

    state_key = "exp_avg"
    update = contract.UPDATE_SIGN

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, decoupled_weight_decay=False, *,
                 block_size=None, min_size=4096, backend="auto", bits=8, rounding="auto"):
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay)
        self._check_group(defaults, "the arguments")
        self._init_lr, self.decoupled_wd = float(lr), bool(decoupled_weight_decay)
        if self.decoupled_wd and self._init_lr == 0:
            raise ArgumentError("decoupled_weight_decay divides weight_decay by lr, which is 0")
        super().__init__(params, defaults, block_size, min_size, backend, bits, rounding)

    def _check_group(self, group: dict, where: str) -> None:
        try:
            _number(group["lr"], "learning rate")
            betas = group["betas"]
            if not isinstance(betas, (tuple, list)) or len(betas) != 2:
                raise ArgumentError(f"betas must be a pair (beta1, beta2), got {betas!r}")
            for i, beta in enumerate(betas):
                _number(beta, f"beta parameter at index {i}", high=1.0)
            _number(group["weight_decay"], "weight_decay value")
        except (ArgumentError, KeyError) as e:
            raise ArgumentError(f"{where}: {e}") from None

    def _coefficients(self, group: dict, fresh: bool) -> tuple:
        beta1, beta2 = group["betas"]
        wd = group["weight_decay"] / self._init_lr if self.decoupled_wd else group["weight_decay"]
        return (0.0, beta2, 1.0 - beta2, beta1, 0.0, 1.0 - beta1, 1.0 - group["lr"] * wd, -group["lr"])


class Muon8bit(_OneState):
    """``torch.optim.Muon`` with a blockwise 8-bit (``bits=4``: 4-bit) ``momentum_buffer``: the momentum and
    the (Nesterov) direction in the grouped kernels, Newton-Schulz and the update as torch's."""

    update = contract.UPDATE_NONE

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=(3.4445, -4.7750, 2.0315), eps=1e-7, ns_steps=5, adjust_lr_fn=None, *,
                 block_size=None, min_size=4096, backend="auto", bits=8, rounding="auto"):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        self._check_group(defaults, "the arguments")
        super().__init__(params, defaults, block_size, min_size, backend, bits, rounding)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ArgumentError(f"Muon only supports 2D parameters whereas we found a parameter with size: "
                                        f"{p.size()}; optimize the others with AdamW8bit")

    def _check_group(self, group: dict, where: str) -> None:
        try:
            _number(group["lr"], "learning rate")
            _number(group["momentum"], "momentum value", high=1.0, closed=False)
            _number(group["weight_decay"], "weight_decay value")
            _number(group["eps"], "eps value")
            if group["adjust_lr_fn"] not in (None, "original", "match_rms_adamw"):
                raise ArgumentError(f"Adjust learning rate function {group['adjust_lr_fn']} is not supported")
            if type(group["ns_steps"]) is not int or not 0 <= group["ns_steps"] < 100:
                raise ArgumentError(f"ns_steps must be an int in [0, 100), got {group['ns_steps']!r}")
            if len(group["ns_coefficients"]) != 3:
                raise ArgumentError("ns_coefficients must be a tuple of exactly 3 values")
        except (ArgumentError, KeyError, TypeError) as e:
            raise ArgumentError(f"{where}: {e}") from None

    def _coefficients(self, group: dict, fresh: bool) -> tuple:
        mom = group["momentum"]
        c_new, c_grad = (mom, 1.0 - mom) if group["nesterov"] else (1.0, 0.0)
        return (0.0, mom, 1.0 - mom, 0.0, c_new, c_grad, 1.0, 0.0)

    def _apply(self, group: dict, params: list, directions: list) -> None:
        from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

        for p, d in zip(params, directions):
            local = dtensor.local(p)
            update = d.view(local.shape)
            if dtensor.is_dtensor(p):  # Newton-Schulz needs the whole matrix: DTensor gathers what it needs
                from torch.distributed.tensor import DTensor

                update = DTensor.from_local(update, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            update = _zeropower_via_newtonschulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(update, alpha=-_adjust_lr(group["lr"], group["adjust_lr_fn"], p.shape))


class SGD4bit(SGD8bit):
    """``SGD8bit`` with ``bits=4``."""

    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **{"bits": 4, **kwargs})


class Lion4bit(Lion8bit):
    """``Lion8bit`` with ``bits=4``."""

    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **{"bits": 4, **kwargs})


class Muon4bit(Muon8bit):
    """``Muon8bit`` with ``bits=4``."""

    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **{"bits": 4, **kwargs})


__all__ = ["SGD8bit", "Lion8bit", "Muon8bit", "SGD4bit", "Lion4bit", "Muon4bit"]
