"""``RAdam8bit`` (and ``RAdam4bit``): ``torch.optim.RAdam`` (decoupled_weight_decay) with Adam's states in Adam's
form (``exp_avg`` as the ratio to ``exp_avg_sq``, which ``ckptq convert`` writes for RAdam's state). Rule:
``ckptq.kernels.rules.radam``. After Liu et al., "On the Variance of the Adaptive Learning Rate and Beyond"
(ICLR 2020)."""

from __future__ import annotations

from ..codec import policy
from ..kernels import rules
from . import args as optim_args
from .adam_rule import ADAM_STATES
from .engine import LowBitOptimizer


class RAdam8bit(LowBitOptimizer):
    """``torch.optim.RAdam`` with blockwise 8-bit (``bits=4``: 4-bit) moments."""

    RULE = rules.RADAM
    STATES = ADAM_STATES[:2]

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled_weight_decay=False,
                 *, foreach=None, maximize=False, capturable=False, differentiable=False, block_size=None,
                 min_size=4096, backend="auto", bits=8, rounding="auto"):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        decoupled_weight_decay=decoupled_weight_decay, foreach=foreach, maximize=maximize,
                        capturable=capturable, differentiable=differentiable)
        super().__init__(params, defaults, block_size=block_size, min_size=min_size, backend=backend, bits=bits,
                         rounding=rounding)

    def _check_group(self, group: dict) -> None:
        optim_args.check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        optim_args.check_flags(group)
        if group["decoupled_weight_decay"]:
            optim_args.check_decay(float(group["lr"]), float(group["weight_decay"]))

    def _ratio_eps(self, group: dict, step: float) -> float:
        return max(float(group["eps"]), policy.MIN_RATIO_EPS)  # the denominator is sqrt(v) + eps

    def _values(self, group: dict) -> tuple:
        return (group["lr"], *group["betas"], group["eps"], group["weight_decay"],
                float(group["decoupled_weight_decay"]))

    def _formula(self, x, lr, beta1, beta2, eps, weight_decay, decoupled, *, step, fresh) -> dict:
        bc1, bc2 = 1.0 - x.pow(beta1, step), 1.0 - x.pow(beta2, step)
        rho_inf = 2.0 / (1.0 - beta2) - 1.0
        rho_t = rho_inf - x.div(2.0 * step * x.pow(beta2, step), bc2)
        tractable = rho_t > 5.0
        inner = x.div((rho_t - 4.0) * (rho_t - 2.0) * rho_inf, (rho_inf - 4.0) * (rho_inf - 2.0) * rho_t)
        rect = x.sqrt(x.maximum(inner, 0.0))  # used only where tractable (inner > 0 there)
        decoupled = decoupled != 0  # a value like any other: one per member on the device (capturable)
        return {"decay": x.where(decoupled, 1.0 - lr * weight_decay, 1.0), "l2": x.where(decoupled, 0.0, weight_decay),
                "one_minus_beta1": 1.0 - beta1, "beta2": beta2, "one_minus_beta2": 1.0 - beta2, "eps": eps,
                "neg_step_size": x.where(tractable, x.div(-lr * rect * x.sqrt(bc2), bc1), x.div(-lr, bc1)),
                "bc2_sqrt": 1.0, "encode_eps": x.maximum(eps, policy.MIN_RATIO_EPS),
                "rectify": x.where(tractable, 1.0, 0.0)}


class RAdam4bit(RAdam8bit):
    """``RAdam8bit`` with ``bits=4``."""

    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **{"bits": 4, **kwargs})
