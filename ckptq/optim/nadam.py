"""``NAdam8bit`` (and ``NAdam4bit``): ``torch.optim.NAdam`` (momentum_decay, decoupled_weight_decay) with Adam's
states in Adam's form (``exp_avg`` as the ratio to ``exp_avg_sq``, which ``ckptq convert`` writes for NAdam's
state) and torch's ``mu_product`` kept exact (a 0-dim fp32 tensor per parameter, as torch's). Rule:
``ckptq.kernels.rules.nadam``. After Dozat, "Incorporating Nesterov Momentum into Adam" (2016)."""

from __future__ import annotations

from ..kernels import rules
from . import args as optim_args
from .adam_rule import ADAM_STATES, adam_fields
from .engine import LowBitOptimizer


class NAdam8bit(LowBitOptimizer):
    """``torch.optim.NAdam`` with blockwise 8-bit (``bits=4``: 4-bit) moments."""

    RULE = rules.NADAM
    STATES = ADAM_STATES[:2]
    SCALAR_STATES = {"mu_product": 1.0}

    def __init__(self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, momentum_decay=4e-3,
                 decoupled_weight_decay=False, *, foreach=None, maximize=False, capturable=False, differentiable=False,
                 block_size=None, min_size=4096, backend="auto", bits=8, rounding="auto"):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, momentum_decay=momentum_decay,
                        decoupled_weight_decay=decoupled_weight_decay, foreach=foreach, maximize=maximize,
                        capturable=capturable, differentiable=differentiable)
        super().__init__(params, defaults, block_size=block_size, min_size=min_size, backend=backend, bits=bits,
                         rounding=rounding)

    def _check_group(self, group: dict) -> None:
        optim_args.check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        optim_args.number(group["momentum_decay"], "momentum_decay", shown="momentum_decay value")
        optim_args.check_flags(group)
        if group["decoupled_weight_decay"]:
            optim_args.check_decay(float(group["lr"]), float(group["weight_decay"]))

    def _values(self, group: dict) -> tuple:
        return (group["lr"], *group["betas"], group["eps"], group["weight_decay"], group["momentum_decay"],
                float(group["decoupled_weight_decay"]))

    def _formula(self, x, lr, beta1, beta2, eps, weight_decay, momentum_decay, decoupled, *, step, fresh,
                 mu_product=1.0) -> dict:
        fields = adam_fields(x, lr, beta1, beta2, eps, weight_decay, step, decoupled)
        mu = beta1 * (1.0 - 0.5 * x.pow(0.96, step * momentum_decay))
        mu_next = beta1 * (1.0 - 0.5 * x.pow(0.96, (step + 1.0) * momentum_decay))
        mu_product = x.f32(x.f32(mu_product) * x.f32(mu))  # torch: the fp32 tensor mu_product *= mu
        fields["neg_grad_step"] = x.div(-lr * (1.0 - mu), 1.0 - mu_product)
        fields["neg_step_size"] = x.div(-lr * mu_next, 1.0 - mu_product * mu_next)
        fields["mu_product"] = mu_product
        return fields


class NAdam4bit(NAdam8bit):
    """``NAdam8bit`` with ``bits=4``."""

    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **{"bits": 4, **kwargs})
