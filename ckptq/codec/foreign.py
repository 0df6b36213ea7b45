"""Other libraries' 8-bit Adam state, read into torch's fp32 form: ckptq as the bridge between them.

bitsandbytes (``AdamW8bit``/``Adam8bit``): per parameter ``{"step": int, "state1", "state2", "qmap1",
"qmap2", "absmax1", "absmax2"}`` (blockwise: value = qmap[code] * absmax[i // block]) or ``max1``/``max2``
(one scale per tensor), flat in releases before 0.45 and nested under ``__bnb_optimizer_quant_state__``
since; ``state1``/``state2`` are fp32 tensors for parameters below its ``min_8bit_size``. ``state1`` is
Adam's first moment and ``state2`` its second, both stored as they are (no sqrt).

torchao (``torchao.optim.AdamW8bit``/``4bit``/``Fp8``): ``exp_avg``/``exp_avg_sq`` are tensor subclasses
(``OptimState8bit``...) whose ``dequantize()`` gives the fp32 values; loading such a file needs torchao
and ``--trust`` (torch.load refuses the classes otherwise).
"""

from __future__ import annotations

from typing import Any

import torch

from . import checkpoint
from ..errors import InputError

BNB_NESTED = "__bnb_optimizer_quant_state__"
_BNB_KEYS = {"state1", "state2", "qmap1", "qmap2", "absmax1", "absmax2", "max1", "max2", "new_max1", "new_max2",
             "unorm_vec"}


def kind(pstate: Any) -> str | None:
    """"bitsandbytes", "torchao" or None for one parameter's optimizer state."""
    if not isinstance(pstate, dict):
        return None
    if isinstance(pstate.get(BNB_NESTED), dict) or "state1" in pstate:
        return "bitsandbytes"
    if any(_is_torchao(v) for v in pstate.values()):
        return "torchao"
    return None


def _is_torchao(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and type(t).__module__.startswith("torchao") and hasattr(t, "dequantize")


def _bnb_moment(q: dict, i: int, numel: int) -> torch.Tensor:
    codes = q.get(f"state{i}")
    if not isinstance(codes, torch.Tensor):
        raise InputError(f"bitsandbytes state has no state{i} tensor; the state dict is damaged")
    if codes.dtype != torch.uint8:
        return codes.float()
    qmap, absmax = q.get(f"qmap{i}"), q.get(f"absmax{i}", q.get(f"max{i}"))
    if not isinstance(qmap, torch.Tensor) or qmap.numel() != 256 or not isinstance(absmax, torch.Tensor) \
            or absmax.numel() < 1:
        raise InputError(f"bitsandbytes 8-bit state{i} lacks its qmap{i}/absmax{i}; the state dict is damaged")
    block = _block_size(numel, absmax.numel(), i)
    flat = codes.reshape(-1).long()
    scale = absmax.float().reshape(-1).repeat_interleave(block)[: flat.numel()]
    return qmap.float()[flat] * scale


def _block_size(numel: int, n_blocks: int, i: int) -> int:
    """The power of two B with ceil(numel / B) == n_blocks (256 since bitsandbytes 0.44, 2048 before; unique
    when n_blocks > 1); one block, the whole tensor, for ``max{i}`` states."""
    if n_blocks == 1:
        return max(numel, 1)
    for b in (2**k for k in range(5, 17)):
        if -(-numel // b) == n_blocks:
            return b
    raise InputError(f"bitsandbytes state{i}: {n_blocks} scales for {numel} values fit no block size; it is damaged")


def _from_bnb(pstate: dict) -> dict:
    q = pstate[BNB_NESTED] if isinstance(pstate.get(BNB_NESTED), dict) else pstate
    numel = q["state1"].numel() if isinstance(q.get("state1"), torch.Tensor) else 0
    step = pstate.get("step", 0)
    out = {k: v for k, v in pstate.items() if k != BNB_NESTED and k not in _BNB_KEYS}
    out["step"] = torch.tensor(float(step.item() if isinstance(step, torch.Tensor) else step), dtype=torch.float32)
    out["exp_avg"] = _bnb_moment(q, 1, numel).reshape(q["state1"].shape)
    out["exp_avg_sq"] = _bnb_moment(q, 2, numel).reshape(q["state1"].shape)
    return out


def _from_torchao(pstate: dict) -> dict:
    out = {}
    for k, v in pstate.items():
        out[k] = v.dequantize().float() if _is_torchao(v) else v
    return out


def to_torch(obj: Any) -> int:
    """Rewrite, in place, every bitsandbytes/torchao per-parameter state inside ``obj``'s optimizer state
    dicts into torch Adam's fp32 form (``step``, ``exp_avg``, ``exp_avg_sq``). Returns how many."""
    n = 0
    for found in checkpoint.find_optimizers(obj):
        state = found.state_dict["state"]
        for pid, pstate in list(state.items()):
            k = kind(pstate)
            if k is not None:
                state[pid] = _from_bnb(pstate) if k == "bitsandbytes" else _from_torchao(pstate)
                n += 1
    return n
