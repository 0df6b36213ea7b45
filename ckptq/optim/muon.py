"""``Muon8bit`` (and ``Muon4bit``): ``torch.optim.Muon`` (2-D parameters; momentum, nesterov, Newton-Schulz in
torch, as torch's, in bfloat16) with its ``momentum_buffer`` blockwise low-bit (role ``first``). The momentum
and the (Nesterov) direction run in the grouped kernels (``ckptq.kernels.rules.momentum`` writing the
direction), Newton-Schulz and the update as torch's. After Jordan et al., "Muon" (2024)."""

from __future__ import annotations

import math
import numbers

import torch

from ..codec import dtensor, roles
from ..errors import ArgumentError
from ..kernels import rules
from . import args as optim_args
from .engine import LowBitOptimizer
from .spec import State

_BF16_DECADES = 38  # bfloat16 overflows past ~3.4e38: Newton-Schulz growth must stay below


class Muon8bit(LowBitOptimizer):
    """``torch.optim.Muon`` with a blockwise 8-bit (``bits=4``: 4-bit) ``momentum_buffer``."""

    RULE = rules.MOMENTUM
    STATES = (State("momentum_buffer", roles.FIRST),)
    complex_ok = False

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=(3.4445, -4.7750, 2.0315), eps=1e-7, ns_steps=5, adjust_lr_fn=None, *,
                 block_size=None, min_size=4096, backend="auto", bits=8, rounding="auto"):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        super().__init__(params, defaults, block_size=block_size, min_size=min_size, backend=backend, bits=bits,
                         rounding=rounding)

    def _check_group(self, group: dict) -> None:
        lr = optim_args.number(group["lr"], "lr", shown="learning rate")
        optim_args.number(group["momentum"], "momentum", high=1.0, closed=False, shown="momentum value")
        wd = optim_args.number(group["weight_decay"], "weight_decay", shown="weight_decay value")
        optim_args.number(group["eps"], "eps", shown="eps value")
        if group["adjust_lr_fn"] not in (None, "original", "match_rms_adamw"):
            raise ArgumentError(f"Adjust learning rate function {group['adjust_lr_fn']} is not supported")
        if type(group["ns_steps"]) is not int or not 0 <= group["ns_steps"] < 100:
            raise ArgumentError(f"ns_steps must be an int in [0, 100), got {group['ns_steps']!r}")
        _check_coefficients(group["ns_coefficients"], group["ns_steps"])
        for p in group.get("params", ()):
            if isinstance(p, torch.Tensor) and p.ndim != 2:
                raise ArgumentError(f"Muon only supports 2D parameters whereas we found a parameter with size: "
                                    f"{p.size()}; optimize the others with AdamW8bit")
        largest = max((_adjusted(1.0, group["adjust_lr_fn"], p.shape) for p in group.get("params", ())
                       if isinstance(p, torch.Tensor)), default=1.0)
        optim_args.check_fp32(**{"lr * weight_decay": lr * wd, "the adjusted lr": lr * largest})
        optim_args.check_decay(lr, wd)

    def _flags(self, group: dict) -> int:
        return 0  # neither linear nor sign: the kernels write the direction, Newton-Schulz applies it

    def _values(self, group: dict) -> tuple:
        return group["momentum"], float(group["nesterov"])

    def _formula(self, x, momentum, nesterov, *, step, fresh) -> dict:
        nesterov = bool(nesterov)
        return {"l2": 0.0, "keep": momentum, "take": 1.0 - momentum, "c_old": 0.0,
                "c_new": momentum if nesterov else 1.0, "c_grad": 1.0 - momentum if nesterov else 0.0,
                "decay": 1.0, "neg_lr": 0.0}

    def _apply(self, group: dict, params: list, directions: list) -> None:
        from torch.optim._muon import _zeropower_via_newtonschulz

        for p, d in zip(params, directions):
            local = dtensor.local(p)
            update = d.view(local.shape)
            if dtensor.is_dtensor(p):  # Newton-Schulz needs the whole matrix: DTensor gathers what it needs
                from torch.distributed.tensor import DTensor

                update = DTensor.from_local(update, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            update = _zeropower_via_newtonschulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(update, alpha=-_adjusted(group["lr"], group["adjust_lr_fn"], p.shape))


def _adjusted(lr, adjust_lr_fn, shape) -> float:
    """torch.optim.Muon's learning rate adjustment (``_adjust_lr``), here to bound it."""
    from torch.optim._muon import _adjust_lr

    return _adjust_lr(lr, adjust_lr_fn, shape)


def _check_coefficients(coefficients, steps: int) -> None:
    """Three finite numbers whose Newton-Schulz growth stays within bfloat16 over ``steps`` iterations."""
    if not isinstance(coefficients, (tuple, list)) or len(coefficients) != 3:
        raise ArgumentError("ns_coefficients must be a tuple of exactly 3 values")
    if not all(isinstance(c, numbers.Real) and not isinstance(c, bool) and math.isfinite(c) for c in coefficients):
        raise ArgumentError(f"ns_coefficients must be 3 finite numbers, got {coefficients!r:.80}")
    total = sum(abs(float(c)) for c in coefficients)
    if total > 1 and steps * math.log10(total) >= _BF16_DECADES:
        raise ArgumentError(f"ns_coefficients {tuple(coefficients)} grow a matrix by up to {total:.3g} per step: "
                            f"{steps} Newton-Schulz steps overflow bfloat16; use torch's defaults "
                            "(3.4445, -4.775, 2.0315)")


class Muon4bit(Muon8bit):
    """``Muon8bit`` with ``bits=4``."""

    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **{"bits": 4, **kwargs})
