"""Adam's states and scalars, which AdamW8bit / Adam8bit (``ckptq.optim.adam``), NAdam8bit and RAdam8bit
share: the three states as the engine declares them, and the step's scalars of ``rules.ADAM``."""

from __future__ import annotations

from ..codec import policy, roles
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
