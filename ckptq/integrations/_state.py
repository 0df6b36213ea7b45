"""What the framework integrations share: an optimizer state dict with its Adam moments stored 8-bit in
memory, and the state an optimizer loads back from it.

``stored_8bit`` applies the plan ``ckptq convert`` applies to a file (``ckptq.plan``: which states go
8-bit, exp_avg as a ratio to exp_avg_sq) to an in-memory state dict, returning a copy: ``state_dict()``
of a torch optimizer shares each parameter's state dict with the live optimizer, which must not change.
A ckptq ``AdamW8bit``/``Adam8bit`` state dict is already 8-bit and comes back as it is.
"""

from __future__ import annotations

from typing import Any

import torch

from ..codec import checkpoint, plan, policy
from ..optim import Adam8bit, AdamW8bit, to_torch_state_dict


def _copy_containers(obj: Any) -> Any:
    """``obj`` with every dict, list and tuple copied and every tensor shared (no tensor data copied)."""
    if isinstance(obj, dict):
        return {k: _copy_containers(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copy_containers(v) for v in obj)
    return obj


def _state_device(obj: Any) -> str:
    """Where to quantize: CUDA (the Triton kernels) when the state lives there, else the CPU."""
    return "cuda" if any(t.is_cuda for t in checkpoint.iter_tensors(obj)) else "cpu"


def stored_8bit(state_dict: Any, *, block_size: int = 256, min_size: int = policy.DEFAULT_MIN_SIZE) -> tuple[Any, int]:
    """``(copy, count)``: a copy of ``state_dict`` (an optimizer state dict, or any object holding some)
    whose fp32 Adam moments are ckptq's 8-bit state dicts, as ``ckptq convert`` stores them, and how
    many states were quantized (0: nothing to store 8-bit, e.g. AdamW8bit's own state or SGD's)."""
    obj = _copy_containers(state_dict)
    marked = plan.mark(obj, None, block_size, min_size, device=_state_device(obj))
    for d in marked.quantized:
        node = obj
        for k in d.path:
            node = node[k]
        node[d.key] = node[d.key].result()  # the PendingQuant holds the exact divisor: order does not matter
    return obj, len(marked.quantized)


def is_ckptq_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` (or the one a framework wrapper such as accelerate's holds) keeps 8-bit state."""
    return isinstance(getattr(optimizer, "optimizer", optimizer), (AdamW8bit, Adam8bit))


def for_optimizer(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """The state dict ``optimizer`` should load: ckptq's optimizers take 8-bit state as stored; any other
    (torch's AdamW...) gets every 8-bit state decoded to fp32 (``ckptq.optim.to_torch_state_dict``)."""
    if is_ckptq_optimizer(optimizer):
        return state_dict
    return to_torch_state_dict(state_dict, getattr(optimizer, "optimizer", optimizer))
