"""``Lion8bit`` (and ``Lion4bit``): lion-pytorch's ``Lion`` (and bitsandbytes' ``Lion8bit``) with its ``exp_avg``
blockwise low-bit (role ``first``): p <- p * (1 - lr * wd) - lr * sign(beta1 * m + (1 - beta1) * g),
m <- beta2 * m + (1 - beta2) * g. ``decoupled_weight_decay=True`` (a param group value, as every other)
divides weight_decay by the initial lr, as lion-pytorch does. Rule: ``ckptq.kernels.rules.momentum`` (sign
update). After Chen et al., "Symbolic Discovery of Optimization Algorithms" (2023)."""

from __future__ import annotations

from ..codec import roles
from ..errors import ArgumentError
from ..kernels import rules
from . import args as optim_args
from .engine import LowBitOptimizer
from .spec import State


class Lion8bit(LowBitOptimizer):
    """lion-pytorch's ``Lion`` with a blockwise 8-bit (``bits=4``: 4-bit) ``exp_avg``."""

    RULE = rules.MOMENTUM
    STATES = (State("exp_avg", roles.FIRST, slot="momentum_buffer"),)
    KEPT_ON_LOAD = ("decoupled_weight_decay",)  # lion-pytorch keeps it on the optimizer, not in its state dict

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, decoupled_weight_decay=False, *,
                 block_size=None, min_size=4096, backend="auto", bits=8, rounding="auto"):
        self._init_lr = float(optim_args._scalar(lr, "lr"))
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults, block_size=block_size, min_size=min_size, backend=backend, bits=bits,
                         rounding=rounding)

    def _pickled(self) -> tuple:
        return (*super()._pickled(), "_init_lr")

    def _check_group(self, group: dict) -> None:
        lr = optim_args.number(group["lr"], "lr", shown="learning rate")
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ArgumentError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        for i, beta in enumerate(betas):
            optim_args.number(beta, f"betas[{i}]", high=1.0, shown=f"beta parameter at index {i}")
        wd = optim_args.number(group["weight_decay"], "weight_decay", shown="weight_decay value")
        if not isinstance(group["decoupled_weight_decay"], bool):
            raise ArgumentError(f"decoupled_weight_decay must be True or False, got {group['decoupled_weight_decay']!r}")
        if group["decoupled_weight_decay"]:
            if getattr(self, "_init_lr", 0.0) == 0:
                raise ArgumentError("decoupled_weight_decay divides weight_decay by the initial lr, which is 0")
            wd = wd / self._init_lr
        optim_args.check_fp32(**{"lr * weight_decay": lr * wd, "weight_decay / initial lr": wd})
        optim_args.check_decay(lr, wd)

    def _flags(self, group: dict) -> int:
        return self.RULE.flag("sign")

    def _values(self, group: dict) -> tuple:
        wd = group["weight_decay"]
        if group["decoupled_weight_decay"]:
            wd = wd / self._init_lr
        return group["lr"], *group["betas"], wd

    def _formula(self, x, lr, beta1, beta2, weight_decay, *, step, fresh) -> dict:
        return {"l2": 0.0, "keep": beta2, "take": 1.0 - beta2, "c_old": beta1, "c_new": 0.0, "c_grad": 1.0 - beta1,
                "decay": 1.0 - lr * weight_decay, "neg_lr": -lr}


class Lion4bit(Lion8bit):
    """``Lion8bit`` with ``bits=4``."""

    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **{"bits": 4, **kwargs})
