"""Adam(W) on one parameter: the step's scalars, and the state dicts of ``ckptq.optim`` mapped onto
``ckptq.ops``' fused step (quantized moments) or its dense step (small parameters, fp32 moments).

The update math itself lives once, in ``ckptq/kernels/backend_torch.py`` (``adam_math``), which the C
and Triton kernels equal bit for bit. Update math after ``torch.optim.AdamW`` / ``torch.optim.Adam`` and
torchao's ``single_param_adam``; blockwise 8-bit state after Dettmers et al., "8-bit Optimizers via
Block-wise Quantization" (ICLR 2022).
"""

from __future__ import annotations

import torch

from ..codec import dtensor, ops, policy, qstate, scalar_math
from ..errors import UsageError
from ..codec.qstate import QState
from ..kernels.contract import HYPER_FIELDS
from . import scalars
from .args import stochastic

MOMENT_KEYS = policy.MOMENT_KEYS


def hyper_values(lr, beta1, beta2, eps, weight_decay, step, decoupled: bool) -> tuple:
    """The scalars of one step (``step`` counts from 1) in float64: the first 8 of
    ``ckptq.kernels.contract.HYPER_FIELDS``, which the kernels take rounded once to fp32."""
    return adam_fields(scalar_math.HOST, float(lr), beta1, beta2, eps, weight_decay, float(step), decoupled)


def adam_fields(x, lr, beta1, beta2, eps, weight_decay, step, decoupled: bool) -> tuple:
    """``hyper_values`` in the math namespace ``x`` (``ckptq.codec.scalar_math``): on floats (the host), or
    on float64 tensors of step counts (the device, ``capturable=True``)."""
    decay = 1.0 - lr * weight_decay if decoupled else 1.0
    l2 = 0.0 if decoupled else weight_decay
    bc1 = 1.0 - x.pow(beta1, step)
    bc2_sqrt = x.sqrt(1.0 - x.pow(beta2, step))
    return (decay, l2, 1.0 - beta1, beta2, 1.0 - beta2, eps, x.div(-lr, bc1), bc2_sqrt)


def rule(decoupled: bool) -> scalars.Rule:
    """Adam(W)'s scalars for steps that compute them on the device (``ckptq.optim.scalars``): the fields of
    ``hyper_values`` and the encode eps' (``policy.ratio_eps``) from each param group's values."""

    def formula(x, lr, beta1, beta2, eps, weight_decay, step):
        fields = adam_fields(x, lr, beta1, beta2, eps, weight_decay, step, decoupled)
        return (*fields, policy.ratio_eps_of(x, eps, beta2, step))

    return scalars.Rule(lambda g: (g["lr"], *g["betas"], g["eps"], g["weight_decay"]), formula,
                        (*HYPER_FIELDS[:8], "encode_eps"))


def hyper_tensor(lr, beta1, beta2, eps, weight_decay, step, decoupled: bool, device=None) -> torch.Tensor:
    """``hyper_values`` as fp32 [8]."""
    values = hyper_values(lr, beta1, beta2, eps, weight_decay, step, decoupled)
    return torch.tensor(values, dtype=torch.float32, device=device)


def _moments(exp_avg: dict, exp_avg_sq: dict, max_exp_avg_sq: dict | None) -> list[QState]:
    """The quantized moments of one step: one block size, sqrt second moments, and a first moment that is
    plain or the ratio to exp_avg_sq (``ckptq.optim_io`` requantizes anything else on load)."""
    moments = [QState.from_dict(dtensor.unplace(d)) for d in (exp_avg, exp_avg_sq, max_exp_avg_sq) if d is not None]
    m = moments[0]
    if len({q.block_size for q in moments}) != 1 or any(q.transform != "sqrt" for q in moments[1:]) \
            or not (m.transform == "none" or (m.is_ratio and m.divisor == "exp_avg_sq")):
        raise UsageError("the quantized moments of a parameter must share one block size, store "
                         "second moments as sqrt and the first as plain values or the ratio to exp_avg_sq; "
                         "reload the state dict")
    return moments


def step_quantized(param, grad, exp_avg: dict, exp_avg_sq: dict, max_exp_avg_sq: dict | None, hyper: torch.Tensor, *,
                   ratio_eps: float, maximize: bool = False, backend: str = "auto", seed: int | None = None) -> None:
    """One low-bit Adam(W) step on one parameter, in place (param, and each qstate dict's codes/absmax), each
    moment keeping its code width.

    ``hyper``: ``hyper_tensor``'s fp32 [8]. Afterwards exp_avg holds ratio codes with eps' = ``ratio_eps``
    (``policy.ratio_eps`` of this step) on ``policy.ratio_policy``'s codebook, whatever it held before,
    rounded stochastically with ``seed`` (``ops.adam8bit_step``) or, without one, to nearest.
    """
    moments = _moments(exp_avg, exp_avg_sq, max_exp_avg_sq)
    m = moments[0]
    encode = m.qmap if m.is_ratio else policy.ratio_policy(m.bits).qmap().to(m.qmap.device)
    eps = torch.tensor((m.eps if m.is_ratio else 0.0, ratio_eps), dtype=torch.float32)
    h = torch.cat((hyper.to("cpu", torch.float32)[:8], eps))  # + decode eps', encode eps' (on the host)
    inputs = [ops.StepInput(q.codes, q.absmax, q.qmap, encode if i == 0 else q.qmap) for i, q in enumerate(moments)]
    if any(q.row_len != m.row_len for q in moments):
        raise UsageError("the quantized moments of a parameter must share one layout; reload the state dict")
    ops.adam8bit_step(param, grad, inputs, h, block_size=m.block_size, ratio=m.is_ratio, maximize=maximize,
                      backend=backend, bits=[q.bits for q in moments], seed=seed, row_len=m.row_len)
    exp_avg.update(qmap=encode, transform=policy.RATIO_TRANSFORM, eps=float(ratio_eps), divisor="exp_avg_sq")


def step_param(p: torch.Tensor, state: dict, group: dict, decoupled: bool, backend: str, salt: int = 0,
               rounding: str = "auto") -> None:
    """The optimizer's step for one parameter with a gradient and an initialised ``state``; ``salt``: the
    parameter's index in the optimizer.

    Moments under 8 bits are requantized with stochastic rounding. Rounded to nearest, a change smaller
    than half a code's step is lost at every step and the value stays on its code: a 4-bit first moment
    then drifts from fp32's (tools/resume_fidelity.py: mean loss -0.4% resumed), and a 4-bit sqrt(v), which
    moves by ~0.05% a step (beta2 = 0.999), never leaves the level its first steps gave it relative to its
    block (training from scratch: mean loss +2.5% over the last 100 of 400 steps; README). Unbiased rounding
    keeps both moving. 8-bit codes are fine enough to round to nearest."""
    state["step"] += 1
    beta1, beta2 = group["betas"]
    hyper = hyper_tensor(group["lr"], beta1, beta2, group["eps"], group["weight_decay"], float(state["step"]),
                         decoupled)  # on the host: the kernels take scalars, no copy to the GPU per parameter
    moments = [state.get(k) if group["amsgrad"] else None for k in MOMENT_KEYS]
    moments[:2] = state["exp_avg"], state["exp_avg_sq"]
    if not qstate.is_qstate(moments[0]):
        ops.adam_dense_step(p, p.grad, *moments, hyper, maximize=group["maximize"])
        return
    seed = ops.step_seed(state["step"], salt) if stochastic(rounding, moments[0].get("bits", 8)) else None
    step_quantized(p, p.grad, *moments, hyper, ratio_eps=policy.ratio_eps_for(group, state["step"]),
                   maximize=group["maximize"], backend=backend, seed=seed)
