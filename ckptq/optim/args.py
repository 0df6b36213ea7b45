"""Argument and param-group checks for ``ckptq.optim``: the same conditions and message openings as
``torch.optim.Adam(W)`` ("Invalid learning rate: ..."), raised as ``ArgumentError`` (a ``ValueError``),
at construction, in ``add_param_group`` and in ``load_state_dict`` before anything changes.

torch's implementation flags and what they mean here:

- ``foreach`` (None/True/False): accepted, no effect. ckptq always steps a param group's low-bit
  parameters together, one fused kernel call per group (the C kernel on the CPU, Triton on CUDA), and its
  small fp32 ones in one more call; there is no per-parameter path to choose instead.
- ``fused`` (None/True/False): accepted, no effect, for the same reason: every step is fused.
- ``capturable`` (True/False): as torch's. True keeps each parameter's step count on its device and
  computes the step's scalars there (``ckptq.optim.scalars``): nothing is read back to the host, and the
  step can be captured in a CUDA graph. Accepted on the CPU too (torch refuses it there), with the same
  results as False.
- ``differentiable``: False accepted; True is refused (8-bit moments carry no autograd history).
"""

from __future__ import annotations

import math
import numbers

import torch

from ..codec import ops, policy
from ..errors import ArgumentError

IMPL_FLAGS = {"foreach": None, "fused": None, "capturable": False, "differentiable": False}
HYPER_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
GROUP_FLAGS = {"amsgrad": False, "maximize": False, **IMPL_FLAGS}  # what torch's Adam fills in when absent


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _scalar(x, name: str):
    """A real number or a 1-element floating tensor; ArgumentError otherwise."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ArgumentError(f"Tensor {name} must be 1-element, got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise ArgumentError(f"Tensor {name} must be floating point, got {x.dtype}")
        if x.is_meta:
            raise ArgumentError(f"Tensor {name} is on the meta device and has no value; pass a number")
        return float(x)
    if not _is_number(x):
        raise ArgumentError(f"{name} must be a number, got {type(x).__name__} {x!r}")
    return float(x)


def check_hyper(lr, betas, eps, weight_decay) -> None:
    """torch.optim.Adam(W)'s checks: lr, eps, weight_decay >= 0 and 0 <= beta < 1; beyond torch's, every
    value finite and the step's scalars finite in fp32 (torch accepts lr=inf and weight_decay=inf, and the
    parameters are inf or NaN after one step)."""
    lr_value = _scalar(lr, "lr")
    if not 0.0 <= lr_value:
        raise ArgumentError(f"Invalid learning rate: {lr} (must be >= 0)")
    if lr_value == math.inf:
        raise ArgumentError("Invalid learning rate: inf (must be finite: one step would make every parameter inf or NaN)")
    eps_value = _scalar(eps, "eps")
    if not 0.0 <= eps_value:
        raise ArgumentError(f"Invalid epsilon value: {eps} (must be >= 0)")
    if eps_value == math.inf:  # torch accepts it: every update becomes 0, weight decay alone acts
        raise ArgumentError(
            "Invalid epsilon value: inf (must be finite: torch.optim.Adam(W) accepts it and makes every update 0, "
            "but 8-bit state stores exp_avg relative to sqrt(exp_avg_sq) + eps and would decode it as NaN; "
            "to freeze parameters use lr=0)"
        )
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ArgumentError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    if isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor):
        raise ArgumentError("betas must be either both floats or both Tensors")
    for i, beta in enumerate(betas):
        name = f"betas[{i}]"
        if not 0.0 <= _scalar(beta, name) < 1.0:
            raise ArgumentError(f"Invalid beta parameter at index {i}: {beta} (must lie in [0, 1))")
    decay = _scalar(weight_decay, "weight_decay")
    if not 0.0 <= decay:
        raise ArgumentError(f"Invalid weight_decay value: {weight_decay} (must be >= 0)")
    if decay == math.inf:
        raise ArgumentError("Invalid weight_decay value: inf (must be finite: one step would make every parameter inf or "
                            "NaN)")
    _check_step_scalars(lr_value, _scalar(betas[0], "betas[0]"), decay)


FP32_MAX = float(torch.finfo(torch.float32).max)


def _check_step_scalars(lr: float, beta1: float, weight_decay: float) -> None:
    """The step's largest scalars (``adam.hyper_values`` at step 1: lr * weight_decay in the decay, the step
    size lr / (1 - beta1)) must be finite in fp32, which the kernels take them in."""
    decay, step = lr * weight_decay, lr / (1.0 - beta1)
    if decay > FP32_MAX or step > FP32_MAX:
        raise ArgumentError(f"Invalid learning rate: {lr} with weight_decay {weight_decay} and betas[0] {beta1} overflows "
                            f"fp32 in the step (lr * weight_decay = {decay:.3g}, lr / (1 - beta1) = {step:.3g}); use "
                            "a smaller lr")


def check_flags(group: dict) -> None:
    """amsgrad/maximize/decoupled_weight_decay are bools; torch's implementation flags take the values
    documented above."""
    for name in ("amsgrad", "maximize", "capturable", "differentiable", "decoupled_weight_decay"):
        if name in group and not isinstance(group[name], bool):
            raise ArgumentError(f"{name} must be True or False, got {group[name]!r}")
    for name in ("foreach", "fused"):
        if name in group and group[name] not in (None, True, False):
            raise ArgumentError(f"{name} must be None, True or False, got {group[name]!r}")
    if group.get("differentiable"):
        raise ArgumentError(
            "differentiable=True is not supported: 8-bit moments carry no autograd history; "
            "use torch.optim for differentiating through the optimizer step"
        )


ROUNDINGS = ("auto", "nearest", "stochastic")


def stochastic(rounding: str, bits: int) -> bool:
    """Whether a state of ``bits``-bit codes is requantized with stochastic rounding under the optimizer's
    ``rounding`` option: "auto" rounds 8-bit codes to nearest and narrower ones stochastically."""
    return rounding == "stochastic" or (rounding == "auto" and bits < 8)


def check_rounding(rounding) -> str:
    if rounding not in ROUNDINGS:
        raise ArgumentError(f"rounding {rounding!r} is not one of {', '.join(ROUNDINGS)}")
    return rounding


def check_options(block_size, min_size, backend, bits=8) -> int:
    """Check ckptq's own options; returns the block size (``None``: the default for ``bits``)."""
    if type(bits) is not int or bits not in policy.BUDGETS:
        raise ArgumentError(f"bits {bits!r} is not supported; use 8 or 4")
    block_size = policy.DEFAULT_BLOCK_SIZES[bits] if block_size is None else block_size
    if block_size not in policy.BLOCK_SIZES:
        raise ArgumentError(f"block_size {block_size!r} is not supported; use a power of two from 64 to 4096")
    if not _is_number(min_size) or int(min_size) != min_size or min_size < 0:
        raise ArgumentError(f"min_size must be a whole number >= 0, got {min_size!r}")
    if backend not in ops.BACKENDS:
        raise ArgumentError(f"backend {backend!r} is not one of {', '.join(ops.BACKENDS)}")
    return block_size


def check_group(group: dict) -> None:
    """Adam(W)'s checks of one param group with every hyperparameter present (defaults filled in)."""
    missing = [k for k in ("params", *HYPER_KEYS) if k not in group]
    if missing:
        raise ArgumentError(f"has no {', '.join(map(repr, missing))}; every param group needs them")
    check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])
    check_flags(group)


def check_params(params, where: str) -> None:
    """Parameters must have storage (not be on ``meta``) to load state for them."""
    for p in params:
        if isinstance(p, torch.Tensor) and p.is_meta:
            raise ArgumentError(
                f"{where} has a parameter on the meta device (shape {tuple(p.shape)}); materialize the model "
                "(e.g. module.to_empty(device=...)) and build the optimizer on its parameters before loading"
            )


def number(x, name: str, low: float = 0.0, high: float = math.inf, closed: bool = True, shown: str | None = None) -> float:
    """A real number (or 1-element float tensor) in [low, high] (``closed``) or [low, high), finite; torch's
    message openings ("Invalid learning rate: ...") under ``shown``, ``name`` for tensors ("Tensor lr ...")."""
    value = _scalar(x, name)
    shown = shown or name
    if math.isnan(value) or not (low <= value <= high if closed else low <= value < high):
        bounds = f"be >= {low:g}" if high == math.inf else f"lie in [{low:g}, {high:g}{']' if closed else ')'}"
        raise ArgumentError(f"Invalid {shown}: {x} (must {bounds})")
    if value == math.inf:
        raise ArgumentError(f"Invalid {shown}: inf (must be finite)")
    return value


def check_decay(lr: float, weight_decay: float) -> None:
    """A decay that shrinks the weights: lr * weight_decay above 2 makes the factor 1 - lr * weight_decay (or
    SGD's) below -1, so every step multiplies the weights by more than their size whatever the gradients (torch
    accepts it; the parameters are inf within a few dozen steps)."""
    if lr * weight_decay > 2.0:
        raise ArgumentError(f"Invalid weight_decay value: {weight_decay:.3g} with lr {lr:.3g} (lr * weight_decay = "
                            f"{lr * weight_decay:.3g} > 2 makes the decay factor 1 - lr * weight_decay < -1: the weights "
                            "grow without bound whatever the gradients); use a smaller weight_decay or lr")


def check_fp32(**named) -> None:
    """The step's derived scalars (lr * weight_decay, lr / (1 - momentum), ...) finite in fp32, which the
    kernels take them in: a group whose step would make every parameter inf or NaN is refused up front."""
    for name, value in named.items():
        if not abs(value) <= FP32_MAX:
            raise ArgumentError(f"Invalid hyperparameters: {name} = {value:.3g} overflows fp32 in the step (the "
                                "parameters would become inf or NaN); use a smaller lr or weight_decay")


def signature_defaults(cls) -> dict:
    """The defaults of an optimizer class's constructor arguments, through its bases (subclasses pass some on as
    ``**kwargs``): what torch's ``__setstate__`` fills in for a flag an older torch did not save."""
    import inspect

    out = {}
    for klass in cls.__mro__:
        if "__init__" in vars(klass) and klass.__module__.startswith("ckptq."):
            for name, p in inspect.signature(klass.__init__).parameters.items():
                if p.default is not inspect.Parameter.empty:
                    out.setdefault(name, p.default)
    return out
