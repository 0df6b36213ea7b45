"""8-bit and 4-bit Adam and AdamW (``torch.optim.Adam`` / ``AdamW``'s arguments and state keys) on the engine.

State per parameter: ``step`` (0-dim fp32 tensor, as torch), ``exp_avg``, ``exp_avg_sq`` and, with amsgrad,
``max_exp_avg_sq``: low-bit from ``min_size`` elements (uint8 codes + fp32 absmax per block, in rows:
``ckptq.codec.qstate``), fp32 below. ``exp_avg`` is stored as the ratio m / (sqrt(v) + eps') to
``exp_avg_sq`` (eps' = ``policy.ratio_eps`` of the step), exactly as ``ckptq convert`` writes it: the update
then carries only the ratio's rounding error. ``bits=4`` (or the ``AdamW4bit``/``Adam4bit`` classes) stores
two 4-bit codes per byte on 16-entry codebooks, block 128 by default; its moments round stochastically
(``rounding="auto"``). A ``ckptq convert --bits 4`` file stores the ratio in 6 bits and sqrt(v) in 2
(``policy.convert_width``); loading one requantizes it to 4 + 4.

Update math after ``torch.optim.AdamW`` / ``Adam`` and torchao's ``single_param_adam`` (the rule:
``ckptq.kernels.rules.adam``); blockwise 8-bit state after Dettmers et al., "8-bit Optimizers via Block-wise
Quantization" (ICLR 2022).
"""

from __future__ import annotations

import torch

from ..codec import policy, roles, scalar_math
from ..errors import ArgumentError
from ..kernels import rules
from . import args as optim_args
from .args import GROUP_FLAGS
from .engine import LowBitOptimizer
from .spec import State

ADAM_STATES = (State("exp_avg", roles.ADAM, "ratio", divisor="exp_avg_sq"), State("exp_avg_sq", roles.ADAM, "sqrt"),
               State("max_exp_avg_sq", roles.ADAM, "sqrt", seeded=False))


def adam_fields(x, lr, beta1, beta2, eps, weight_decay, step, decoupled) -> dict:
    """Adam(W)'s scalars (``rules.ADAM_FIELDS`` but the decode eps') in the math namespace ``x``
    (``ckptq.codec.scalar_math``): on floats (the host), or on float64 tensors of step counts (the device).
    ``decoupled`` (AdamW's decay, else L2) is a bool or, like every value, one per member on the device."""
    bc1 = 1.0 - x.pow(beta1, step)
    decoupled = decoupled != 0
    return {"decay": x.where(decoupled, 1.0 - lr * weight_decay, 1.0), "l2": x.where(decoupled, 0.0, weight_decay),
            "one_minus_beta1": 1.0 - beta1, "beta2": beta2, "one_minus_beta2": 1.0 - beta2, "eps": eps,
            "neg_step_size": x.div(-lr, bc1), "bc2_sqrt": x.sqrt(1.0 - x.pow(beta2, step)),
            "encode_eps": policy.ratio_eps_of(x, eps, beta2, step)}


def hyper_values(lr, beta1, beta2, eps, weight_decay, step, decoupled: bool) -> tuple:
    """The first 8 of ``rules.ADAM_FIELDS`` of one step (``step`` counts from 1), float64 on the host."""
    fields = adam_fields(scalar_math.HOST, float(lr), beta1, beta2, eps, weight_decay, float(step), decoupled)
    return tuple(fields[name] for name in rules.ADAM_FIELDS[:8])


def hyper_tensor(lr, beta1, beta2, eps, weight_decay, step, decoupled: bool, device=None) -> torch.Tensor:
    """``hyper_values`` as fp32 [8]."""
    return torch.tensor(hyper_values(lr, beta1, beta2, eps, weight_decay, step, decoupled), dtype=torch.float32,
                        device=device)


class _Adam(LowBitOptimizer):
    RULE = rules.ADAM
    STATES = ADAM_STATES
    decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 maximize=False, foreach=None, fused=None, capturable=False, differentiable=False,
                 decoupled_weight_decay=False, block_size=None, min_size=4096, backend="auto", bits=8, rounding="auto"):
        """torch.optim.Adam(W)'s arguments (``foreach``/``fused``/``capturable``/``differentiable`` as
        ``ckptq.optim.args`` documents; ``decoupled_weight_decay=True`` makes Adam8bit AdamW8bit, as in
        torch), plus ``bits`` (8 or 4), ``block_size`` (default 256 for 8 bits,
        128 for 4), ``min_size`` and ``backend`` for the quantized state, and ``rounding``: how the moments'
        new codes are rounded at every step: "auto" (to nearest at 8 bits, stochastically below), "nearest"
        or "stochastic" (seeded by the step count and the parameter's index: a resumed run draws the same
        numbers). Bad values raise ``ArgumentError``, a ``ValueError``, before anything is built."""
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        foreach=foreach, fused=fused, capturable=capturable, differentiable=differentiable,
                        decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults, block_size=block_size, min_size=min_size, backend=backend, bits=bits,
                         rounding=rounding)

    def _check_group(self, group: dict) -> None:
        optim_args.check_group(group)
        if self.decoupled:
            optim_args.check_decay(float(group["lr"]), float(group["weight_decay"]))

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # groups pickled before a flag existed, as torch's Adam does
            for key, default in GROUP_FLAGS.items():
                group.setdefault(key, default)
            group.setdefault("decoupled_weight_decay", self.decoupled)

    def _flags(self, group: dict) -> int:
        return self.RULE.flag("amsgrad") if group["amsgrad"] else 0

    def _values(self, group: dict) -> tuple:
        decoupled = self.decoupled or group["decoupled_weight_decay"]
        return (group["lr"], *group["betas"], group["eps"], group["weight_decay"], float(decoupled))

    def _formula(self, x, lr, beta1, beta2, eps, weight_decay, decoupled, *, step, fresh) -> dict:
        return adam_fields(x, lr, beta1, beta2, eps, weight_decay, step, decoupled)


class AdamW8bit(_Adam):
    """``torch.optim.AdamW`` with blockwise 8-bit moments (decoupled weight decay; default 1e-2)."""

    decoupled = True  # whatever a loaded group says, as torch's AdamW forces decoupled_weight_decay
    KEPT_ON_LOAD = ("decoupled_weight_decay",)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, **kwargs):
        if "decoupled_weight_decay" in kwargs:  # torch's AdamW does not take it either
            raise TypeError(f"{type(self).__name__}() got an unexpected keyword argument 'decoupled_weight_decay'")
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, decoupled_weight_decay=True, **kwargs)


class Adam8bit(_Adam):
    """``torch.optim.Adam`` with blockwise 8-bit moments (L2 weight decay added to the gradient)."""

    decoupled = False


class AdamW4bit(AdamW8bit):
    """``AdamW8bit`` with ``bits=4``: two 4-bit codes per byte, block 128 (about 1.06 bytes per parameter
    for both moments instead of 2.03)."""

    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **{"bits": 4, **kwargs})


class Adam4bit(Adam8bit):
    """``Adam8bit`` with ``bits=4`` (see ``AdamW4bit``)."""

    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **{"bits": 4, **kwargs})


__all__ = ["AdamW8bit", "Adam8bit", "AdamW4bit", "Adam4bit", "hyper_values", "hyper_tensor", "adam_fields"]
