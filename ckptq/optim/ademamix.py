"""``AdEMAMix8bit`` (and ``AdEMAMix4bit``): bitsandbytes' ``AdEMAMix`` (betas (b1, b2, b3), alpha, t_alpha, t_beta3,
eps, weight_decay) with its three states blockwise low-bit: the fast and the slow EMA of the gradient
(``exp_avg``, ``exp_avg_slow``: role ``first``) and the second moment (``exp_avg_sq``: sqrt, role ``second``),
the keys torch-optimi's AdEMAMix uses. Rule: ``ckptq.kernels.rules.ademamix``. After Pagliardini et al., "The
AdEMAMix Optimizer: Better, Faster, Older" (2024), and bitsandbytes' implementation (its alpha and beta3
schedules)."""

from __future__ import annotations

import math

from ..codec import roles
from ..errors import ArgumentError
from ..kernels import rules
from . import args as optim_args
from .engine import LowBitOptimizer
from .spec import State


class AdEMAMix8bit(LowBitOptimizer):
    """bitsandbytes' ``AdEMAMix`` with blockwise 8-bit (``bits=4``: 4-bit) states."""

    RULE = rules.ADEMAMIX
    STATES = (State("exp_avg", roles.FIRST), State("exp_avg_slow", roles.FIRST),
              State("exp_avg_sq", roles.SECOND, "sqrt"))

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha=None, t_beta3=None, eps=1e-8,
                 weight_decay=1e-2, *, maximize=False, block_size=None, min_size=4096, backend="auto", bits=8,
                 rounding="auto"):
        defaults = dict(lr=lr, betas=betas, alpha=alpha, t_alpha=t_alpha, t_beta3=t_beta3, eps=eps,
                        weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults, block_size=block_size, min_size=min_size, backend=backend, bits=bits,
                         rounding=rounding)

    def _check_group(self, group: dict) -> None:
        lr = optim_args.number(group["lr"], "lr", shown="learning rate")
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 3:
            raise ArgumentError(f"betas must be a triple (beta1, beta2, beta3), got {betas!r:.60}")
        for i, beta in enumerate(betas):
            optim_args.number(beta, f"betas[{i}]", high=1.0, closed=False, shown=f"beta parameter at index {i}")
        optim_args.number(group["alpha"], "alpha", shown="alpha value")
        for name in ("t_alpha", "t_beta3"):
            value = group[name]
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ArgumentError(f"{name} must be None or a whole number of steps >= 1, got {value!r:.40}")
        if group["t_beta3"] is not None and not (betas[0] > 0 and betas[2] > 0):
            raise ArgumentError("the beta3 schedule (t_beta3) interpolates logarithms: betas[0] and betas[2] "
                                "must be > 0")
        optim_args.number(group["eps"], "eps", shown="epsilon value")
        wd = optim_args.number(group["weight_decay"], "weight_decay", shown="weight_decay value")
        optim_args.check_flags(group)
        optim_args.check_fp32(**{"lr * weight_decay": lr * wd, "lr / (1 - beta1)": lr / (1.0 - betas[0]),
                                 "lr * alpha": lr * group["alpha"]})
        optim_args.check_decay(lr, wd)

    def _values(self, group: dict) -> tuple:
        t_alpha, t_beta3 = group["t_alpha"], group["t_beta3"]
        return (group["lr"], *group["betas"], group["alpha"], float(t_alpha or 0), float(t_beta3 or 0),
                group["eps"], group["weight_decay"])

    def _formula(self, x, lr, beta1, beta2, beta3, alpha, t_alpha, t_beta3, eps, weight_decay, *, step,
                 fresh) -> dict:
        if t_alpha:  # bitsandbytes' schedules: alpha ramps up linearly, beta3 log-linearly from beta1
            alpha = x.minimum(step * alpha / t_alpha, alpha)
        if t_beta3:
            ln1, ln3, s = math.log(beta1), math.log(beta3), step / t_beta3
            beta3 = x.minimum(x.exp(x.div(ln1 * ln3, (1.0 - s) * ln3 + s * ln1)), beta3)
        return {"decay": 1.0 - lr * weight_decay, "one_minus_beta1": 1.0 - beta1, "one_minus_beta3": 1.0 - beta3,
                "beta2": beta2, "one_minus_beta2": 1.0 - beta2, "eps": eps, "neg_lr": -lr,
                "bc2_sqrt": x.sqrt(1.0 - x.pow(beta2, step)), "bc1": 1.0 - x.pow(beta1, step), "alpha": alpha}


class AdEMAMix4bit(AdEMAMix8bit):
    """``AdEMAMix8bit`` with ``bits=4``."""

    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **{"bits": 4, **kwargs})
