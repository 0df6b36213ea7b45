"""``Adagrad8bit`` (and ``Adagrad4bit``): ``torch.optim.Adagrad`` (lr_decay, weight_decay,
initial_accumulator_value, eps, maximize) with its ``sum`` blockwise low-bit as sqrt (role ``second``), the
form ``ckptq convert`` writes. Rule: ``ckptq.kernels.rules.adagrad``. After Duchi et al., "Adaptive
Subgradient Methods" (JMLR 2011)."""

from __future__ import annotations

from ..codec import roles
from ..errors import ArgumentError
from ..kernels import rules
from . import args as optim_args
from .engine import LowBitOptimizer
from .spec import State


class Adagrad8bit(LowBitOptimizer):
    """``torch.optim.Adagrad`` with a blockwise 8-bit (``bits=4``: 4-bit) ``sum``."""

    RULE = rules.ADAGRAD
    STATES = (State("sum", roles.SECOND, "sqrt", init="initial_accumulator_value"),)

    def __init__(self, params, lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10,
                 foreach=None, *, maximize=False, differentiable=False, fused=None, block_size=None, min_size=4096,
                 backend="auto", bits=8, rounding="auto"):
        defaults = dict(lr=lr, lr_decay=lr_decay, eps=eps, weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value, foreach=foreach, maximize=maximize,
                        differentiable=differentiable, fused=fused)
        super().__init__(params, defaults, block_size=block_size, min_size=min_size, backend=backend, bits=bits,
                         rounding=rounding)

    def _check_group(self, group: dict) -> None:
        lr = optim_args.number(group["lr"], "lr", shown="learning rate")
        optim_args.number(group["lr_decay"], "lr_decay", shown="lr_decay value")
        wd = optim_args.number(group["weight_decay"], "weight_decay", shown="weight_decay value")
        optim_args.number(group["initial_accumulator_value"], "initial_accumulator_value",
                          shown="initial_accumulator_value value")
        optim_args.number(group["eps"], "eps", shown="epsilon value")
        optim_args.check_flags(group)
        optim_args.check_fp32(**{"lr * weight_decay": lr * wd})

    def _values(self, group: dict) -> tuple:
        return group["lr"], group["lr_decay"], group["weight_decay"], group["eps"]

    def _formula(self, x, lr, lr_decay, weight_decay, eps, *, step, fresh) -> dict:
        return {"l2": weight_decay, "neg_clr": x.div(-lr, 1.0 + (step - 1.0) * lr_decay), "eps": eps}


class Adagrad4bit(Adagrad8bit):
    """``Adagrad8bit`` with ``bits=4``."""

    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **{"bits": 4, **kwargs})
