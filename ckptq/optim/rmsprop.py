"""``RMSprop8bit`` (and ``RMSprop4bit``): ``torch.optim.RMSprop`` (alpha, eps, weight_decay, momentum, centered,
maximize) with its states blockwise low-bit in the form ``ckptq convert`` writes: ``square_avg`` as sqrt
(role ``second``), ``momentum_buffer`` (momentum > 0) and ``grad_avg`` (centered) signed (role ``first``).
Rule: ``ckptq.kernels.rules.rmsprop``. ``centered=True`` takes 8 bits only: the centered denominator
sqrt(square_avg - grad_avg^2) is the difference of two rounded states, which 4-bit codes cannot resolve."""

from __future__ import annotations

from ..codec import roles
from ..errors import ArgumentError
from ..kernels import rules
from . import args as optim_args
from .engine import LowBitOptimizer
from .spec import State


class RMSprop8bit(LowBitOptimizer):
    """``torch.optim.RMSprop`` with blockwise 8-bit (``bits=4``: 4-bit) states."""

    RULE = rules.RMSPROP
    STATES = (State("square_avg", roles.SECOND, "sqrt"), State("momentum_buffer", roles.FIRST),
              State("grad_avg", roles.FIRST))

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False,
                 capturable=False, foreach=None, maximize=False, differentiable=False, *, block_size=None,
                 min_size=4096, backend="auto", bits=8, rounding="auto"):
        defaults = dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum, centered=centered,
                        capturable=capturable, foreach=foreach, maximize=maximize, differentiable=differentiable)
        super().__init__(params, defaults, block_size=block_size, min_size=min_size, backend=backend, bits=bits,
                         rounding=rounding)

    def _check_group(self, group: dict) -> None:
        lr = optim_args.number(group["lr"], "lr", shown="learning rate")
        optim_args.number(group["eps"], "eps", shown="epsilon value")
        mom = optim_args.number(group["momentum"], "momentum", high=1.0, shown="momentum value")
        wd = optim_args.number(group["weight_decay"], "weight_decay", shown="weight_decay value")
        optim_args.number(group["alpha"], "alpha", high=1.0, shown="alpha value")
        if not isinstance(group["centered"], bool):
            raise ArgumentError(f"centered must be True or False, got {group['centered']!r:.40}")
        if group["centered"] and self.bits < 8:
            raise ArgumentError("centered=True needs 8-bit state: at 4 bits square_avg - grad_avg^2 is mostly "
                                "rounding error and the steps diverge (tests/optim/test_optim_breadth.py); use "
                                "RMSprop8bit")
        optim_args.check_flags(group)
        optim_args.check_fp32(**{"lr * weight_decay": lr * wd,
                                 "lr / (1 - momentum)": lr / (1.0 - mom) if mom < 1 else lr})

    def _flags(self, group: dict) -> int:
        heavy = self.RULE.flag("heavy") if group["momentum"] > 0 else 0
        return heavy | (self.RULE.flag("centered") if group["centered"] else 0)

    def _values(self, group: dict) -> tuple:
        return group["lr"], group["alpha"], group["eps"], group["weight_decay"], group["momentum"]

    def _formula(self, x, lr, alpha, eps, weight_decay, momentum, *, step, fresh) -> dict:
        return {"l2": weight_decay, "alpha": alpha, "one_minus_alpha": 1.0 - alpha, "eps": eps, "neg_lr": -lr,
                "momentum": momentum}


class RMSprop4bit(RMSprop8bit):
    """``RMSprop8bit`` with ``bits=4``."""

    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **{"bits": 4, **kwargs})
