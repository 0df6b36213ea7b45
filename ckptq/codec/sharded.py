"""Low-bit optimizer state for DTensor parameters (FSDP2, HSDP, DDP through ``replicate``): placed like the
parameter.

Layout (docs/FORMAT.md, "Sharded state"): a quantized moment of a DTensor parameter of shape
``[d0, d1, ...]`` is in the row layout (``ckptq.codec.qstate``): ``codes`` a uint8 DTensor
``[d0, code_bytes(row, bits)]`` and ``absmax`` an fp32 DTensor ``[d0, ceil(row / block_size)]``
(``row = d1 * d2 * ...``), both with the parameter's placements; ``qmap`` and the scalars are plain values.
Blocks never cross a row, so under ``Shard(0)`` and ``Replicate`` (with the uneven shards FSDP2 makes)
every rank quantizes its own rows, at any width and any row length, and ``torch.distributed.checkpoint``
reshards codes and scales to any world size, and to one process, without changing a bit: the layout is
the one a single process keeps. Parameters that cannot be cut this way keep fp32 (DTensor) state, and the
optimizer says which, once: 1-D parameters (their one row is split across ranks) and parameters sharded
along another dim (tensor parallelism, ``Shard(1)``: a block would straddle ranks, and resharding to
another TP degree could not keep the blocks).
"""

from __future__ import annotations


from . import exactness, policy, quant
from .dtensor import is_dtensor, local, place


def quantize(t, key: str, block_size: int, bits: int = 8) -> dict:
    """fp32 state ``t`` (a tensor, or a ``shardable`` DTensor: quantized shard by shard and placed like it)
    -> qstate in the row layout."""
    q = quant.quantize_state(local(t).float(), key, block_size, bits=bits)
    q["dtype"] = "float32"  # the state is fp32 whatever the checkpoint stored
    return place(q, t) if is_dtensor(t) else q


def quantize_moments(dense: dict, group: dict, step, block_size: int, bits: int = 8) -> dict:
    """fp32 Adam moments {key: tensor or DTensor} -> qstates of ``bits``-bit codes (8 or 4: the optimizer's
    working layout), exp_avg as the ratio to the exact exp_avg_sq with eps' of ``step`` under ``group``'s
    eps/betas: at 8 bits the codes ``ckptq convert`` writes."""
    out = {k: quantize(v, k, block_size, bits) for k, v in dense.items() if k != "exp_avg"}
    m, v = dense["exp_avg"], dense["exp_avg_sq"]
    eps = policy.ratio_eps_for(group, step)
    if not exactness.ratio_fits(local(m), local(v), eps):  # the ratio would overflow fp32: m on its own
        out["exp_avg"] = quantize(m, "exp_avg", block_size, bits)
    else:
        q = quant.quantize_ratio(local(m).float(), local(v).float(), eps, block_size, bits=bits)
        q["dtype"] = "float32"
        out["exp_avg"] = place(q, m) if is_dtensor(m) else q
    return {k: out[k] for k in dense}
