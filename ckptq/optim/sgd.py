"""``SGD8bit`` (and ``SGD4bit``): ``torch.optim.SGD`` (momentum, dampening, nesterov, weight_decay, maximize)
with its ``momentum_buffer`` blockwise low-bit in the form ``ckptq convert`` writes (role ``first``). With
momentum 0 it keeps no state, as torch's. Rule: ``ckptq.kernels.rules.momentum`` (linear update)."""

from __future__ import annotations

from ..codec import roles
from ..errors import ArgumentError
from ..kernels import rules
from . import args as optim_args
from .engine import LowBitOptimizer
from .spec import State


class SGD8bit(LowBitOptimizer):
    """``torch.optim.SGD`` with a blockwise 8-bit (``bits=4``: 4-bit) ``momentum_buffer``."""

    RULE = rules.MOMENTUM
    STATES = (State("momentum_buffer", roles.FIRST),)

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 maximize=False, foreach=None, differentiable=False, fused=None, block_size=None, min_size=4096,
                 backend="auto", bits=8, rounding="auto"):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        maximize=maximize, foreach=foreach, differentiable=differentiable, fused=fused)
        super().__init__(params, defaults, block_size=block_size, min_size=min_size, backend=backend, bits=bits,
                         rounding=rounding)

    def _check_group(self, group: dict) -> None:
        lr = optim_args.number(group["lr"], "lr", shown="learning rate")
        mom = optim_args.number(group["momentum"], "momentum", high=1.0, shown="momentum value")
        optim_args.number(group["dampening"], "dampening", high=1.0, shown="dampening value")
        wd = optim_args.number(group["weight_decay"], "weight_decay", shown="weight_decay value")
        if group["nesterov"] and (mom <= 0 or group["dampening"] != 0):
            raise ArgumentError("Nesterov momentum requires a momentum and zero dampening")
        optim_args.check_flags(group)
        optim_args.check_decay(lr, wd)
        optim_args.check_fp32(**{"lr * weight_decay": lr * wd,
                                 "lr / (1 - momentum)": lr / (1.0 - mom) if mom < 1 else lr})

    def _flags(self, group: dict) -> int:
        return self.RULE.flag("linear")

    def _stateless(self, group: dict) -> bool:
        return group["momentum"] == 0

    def _plain_step(self, group: dict, params: list) -> None:
        """SGD without momentum: no state, torch's update (p -= lr * (g + wd * p))."""
        for p in params:
            g = -p.grad if group["maximize"] else p.grad
            if group["weight_decay"]:
                g = g.add(p, alpha=group["weight_decay"])
            p.add_(g, alpha=-group["lr"])

    def _values(self, group: dict) -> tuple:
        return group["lr"], group["momentum"], group["dampening"], group["weight_decay"], float(group["nesterov"])

    def _formula(self, x, lr, momentum, dampening, weight_decay, nesterov, *, step, fresh) -> dict:
        # torch: buf = g at the first step, then buf = momentum * buf + (1 - dampening) * g
        nesterov = bool(nesterov)
        return {"l2": weight_decay, "keep": x.where(fresh, 0.0, momentum), "take": x.where(fresh, 1.0, 1.0 - dampening),
                "c_old": 0.0, "c_new": momentum if nesterov else 1.0, "c_grad": 1.0 if nesterov else 0.0,
                "decay": 1.0, "neg_lr": -lr}


class SGD4bit(SGD8bit):
    """``SGD8bit`` with ``bits=4``."""

    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **{"bits": 4, **kwargs})
