"""What the framework integrations share: an optimizer state dict as ckptq stores it in memory, and the
state an optimizer loads back from it.

``stored_low_bit`` applies the plan ``ckptq convert`` applies to a file (``ckptq.codec.plan``: which states go
8-bit or 4-bit, exp_avg as a ratio to exp_avg_sq) to an in-memory state dict, returning a copy: ``state_dict()``
of a torch optimizer shares each parameter's state dict with the live optimizer, which must not change.
A ckptq ``AdamW8bit``/``AdamW4bit`` state dict is already low-bit and comes back as it is.

torchao's ``AdamW8bit``/``AdamW4bit`` keep their moments as tensor subclasses (``OptimState8bit``,
``OptimState4bit``), which are blockwise codes with a codebook and scales, as ckptq's are. They are
stored as ckptq qstates holding the same codes, scales and codebook (``foreign.torchao_qstate``), and
rebuilt as the same subclasses on resume: not a bit changes, so training continues exactly as it
would have, with the optimizer's memory unchanged. The files need no torchao to read (torch.save of
the subclasses is unpickled only where torchao is imported) and do not depend on torchao's class names,
which have moved before (``torchao.prototype.low_bit_optim`` until 0.10). Decoding them to fp32 instead
would lose: torchao's ``load_state_dict`` keeps fp32 tensors as fp32 for good (4 bytes a value instead
of 1 or 0.5), and requantizing them rounds a second time. A torchao state without an exact qstate form
(``OptimStateFp8``, a block size outside 64..4096) leaves its optimizer's state dict as the framework
stores it.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..codec import checkpoint, foreign, policy, qstate, quant, signpost, tree
from ..errors import StateMismatchError
from ..optim.engine import LowBitOptimizer
from ..optim.state_io import to_torch_state_dict
from . import _bnb

MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


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


def options(bits: int = 8, block_size: int | None = None, min_size: int = policy.DEFAULT_MIN_SIZE) -> dict:
    """An integration's storage options, checked once, where it is set up (UsageError naming the bad value):
    ``bits`` per value of the moments, 8 or 4 (as ``ckptq convert --bits``); ``block_size`` values per scale
    (None: 256 for 8 bits, 128 for 4); states of fewer than ``min_size`` elements stay fp32."""
    bits = policy.check_budget(bits)
    block = policy.default_block_size(bits) if block_size is None else policy.check_block_size(block_size)
    return {"bits": bits, "block_size": block, "min_size": policy.check_min_size(min_size)}


def stored_low_bit(state_dict: Any, *, bits: int = 8, block_size: int | None = None,
                   min_size: int = policy.DEFAULT_MIN_SIZE) -> tuple[Any, int]:
    """``(copy, count)``: a copy of ``state_dict`` (an optimizer state dict, or any object holding some)
    whose fp32 Adam moments are ckptq's low-bit state dicts at ``bits`` (``options``), as ``ckptq convert
    --bits`` stores them, and whose torchao states are their exact qstates (at torchao's own width, whatever
    ``bits``); ``count``: how many states changed form (0: ``state_dict`` itself, stored as the optimizer keeps
    it, e.g. AdamW8bit's, SGD's or bitsandbytes' state)."""
    opts = options(bits, block_size, min_size)
    obj = _copy_containers(state_dict)
    relabeled = foreign.torchao_to_qstates(obj)
    left = sorted({type(t).__name__ for t in checkpoint.iter_tensors(obj) if foreign.is_torchao(t)})
    if left:
        warnings.warn(f"ckptq stores torchao's OptimState8bit and OptimState4bit exactly but not {', '.join(left)}: "
                      "this optimizer's state is saved as the framework saves it", stacklevel=3)
        return state_dict, 0
    marked = tree.mark(obj, None, opts["block_size"], opts["min_size"], bits=opts["bits"], device=_state_device(obj))
    for d in marked.quantized:
        node = obj
        for k in d.path:
            node = node[k]
        node[d.key] = node[d.key].result()  # the PendingQuant holds the exact divisor: order does not matter
    count = len(marked.quantized) + relabeled
    return (obj, count) if count else (state_dict, 0)


def _inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the torch one


def is_ckptq_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` (or the one a framework wrapper such as accelerate's holds) is one of ckptq's: it keeps
    low-bit state, and loads any form of its state itself (AdamW8bit, SGD8bit, Lion8bit, Muon8bit...)."""
    return isinstance(_inner(optimizer), LowBitOptimizer)


def is_torchao_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """torchao's low-bit Adam (``torchao.optim.AdamW8bit``...), told without importing torchao."""
    inner = _inner(optimizer)
    return type(inner).__module__.startswith("torchao.") and hasattr(inner, "_new_buffer")


def for_optimizer(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """The state dict ``optimizer`` should load: ckptq's optimizers take 8-bit state as stored; torchao's
    and bitsandbytes' get each moment in their own form (``_torchao_state``, ``_bnb.state_dict_for``); any
    other (torch's AdamW...) gets every 8-bit state decoded to fp32 (``ckptq.optim.to_torch_state_dict``).
    A signpost carrying its state gives that state; one that does not is a StateMismatchError saying
    where the state went (what a stock framework would have failed on less clearly)."""
    state_dict = signpost.unwrapped(state_dict)[0]
    if signpost.is_signpost(state_dict):
        raise StateMismatchError(state_dict[signpost.SIGNPOST_KEY])
    inner = _inner(optimizer)
    if is_ckptq_optimizer(inner):
        return state_dict
    if _bnb.is_bnb_optimizer(inner):
        return _bnb.state_dict_for(inner, state_dict)
    if is_torchao_optimizer(inner):
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        params = dict(zip(saved_ids, (p for g in inner.param_groups for p in g["params"])))
        state = {pid: _torchao_state(inner, params[pid], s) if pid in params and isinstance(s, dict) else s
                 for pid, s in state_dict["state"].items()}
        return {**state_dict, "state": state}
    return to_torch_state_dict(state_dict, inner)


def _torchao_state(optimizer, p: torch.Tensor, pstate: dict) -> dict:
    """``pstate`` with each moment as the torchao ``optimizer`` keeps it for ``p`` (the zero state its
    ``_new_buffer`` makes): the stored codes themselves where they are in that layout, else the values
    (decoded if 8-bit) quantized into it, so that the optimizer never holds fp32 where it would not."""
    out = dict(pstate)
    for key in MOMENTS:
        value = pstate.get(key)
        if value is None:
            continue
        like = optimizer._new_buffer(p, key == "exp_avg")  # torchao: signed for the first moment only
        if qstate.is_qstate(value):
            exact = foreign.torchao_state(value, like)
            if exact is not None:
                out[key] = exact
                continue
            value = quant.dequantize_state(value, divisor=pstate.get(value.get("divisor")))
        out[key] = like.copy_(value.to(like.device))
    return out


def restored(state_dict: dict, torchao: bool) -> dict:
    """``state_dict`` as ckptq stored it, made loadable without the optimizer at hand (Lightning loads
    the file before it builds the optimizers), in place: with ``torchao``, each qstate in torchao's layout
    becomes torchao's state again (``foreign.torchao_state``); every other 8-bit state is decoded to fp32."""
    if torchao:
        for pstate in state_dict["state"].values():
            for key, value in pstate.items() if isinstance(pstate, dict) else ():
                exact = foreign.torchao_state(value) if qstate.is_qstate(value) else None
                pstate[key] = value if exact is None else exact
    quant.decode_qstates(state_dict)
    return state_dict
