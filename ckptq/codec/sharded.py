"""8-bit optimizer state for DTensor parameters (FSDP2, HSDP): placed like the parameter.

Layout (docs/FORMAT.md, "Sharded state"): a quantized moment of a DTensor parameter of shape
``[d0, d1, ...]`` holds ``codes`` as a uint8 DTensor of the parameter's shape and placements, and
``absmax`` as an fp32 DTensor of shape ``[d0, row / block_size]`` (``row = d1 * d2 * ...``) with the same
placements; ``qmap`` and the scalars are plain values. Blocks run along rows, so with ``row`` a multiple of
``block_size`` they are exactly the blocks of the unsharded flat layout, and no block ever straddles a
dim-0 shard boundary: every rank quantizes its own rows, and ``torch.distributed.checkpoint`` reshards
codes and scales to any world size without changing a bit. Parameters whose rows are not a multiple of
the block size, or that are sharded on another dim, keep fp32 (DTensor) state.
"""

from __future__ import annotations

import sys

import torch

from . import plan, policy, quant
from ..errors import UsageError


def is_dtensor(t) -> bool:
    # No DTensor exists before torch.distributed.tensor is imported, so ckptq never imports it itself
    # (it costs ~50 MB and half a second on every CLI start).
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def row_aligned(p, block_size: int) -> bool:
    """Whether a DTensor parameter can hold 8-bit state: sharded on dim 0 only, rows of whole blocks."""
    from torch.distributed.tensor import Replicate, Shard

    if p.dim() == 0 or any(not (isinstance(pl, Replicate) or pl == Shard(0)) for pl in p.placements):
        return False
    return (p.numel() // p.shape[0]) % block_size == 0


def local(t):
    """The local shard of a DTensor (shares its storage), a plain tensor as it is."""
    return t.to_local() if is_dtensor(t) else t


def place(q: dict, like) -> dict:
    """A qstate dict quantized from ``like.to_local()`` (flat codes and scales) with its codes and scales
    turned into DTensors placed like the DTensor ``like``."""
    from torch.distributed.tensor import DTensor

    per_row = (like.numel() // like.shape[0]) // q["block_size"]
    codes = DTensor.from_local(q["codes"].view(like.to_local().shape), like.device_mesh, like.placements,
                               shape=like.shape, stride=like.stride(), run_check=False)
    absmax = scales_like(like, per_row)
    absmax.to_local().copy_(q["absmax"].view(absmax.to_local().shape))
    return {**q, "codes": codes, "absmax": absmax, "shape": tuple(like.shape)}


def scales_like(like, per_row: int):
    """fp32 zeros for the scales of a qstate of the DTensor ``like``: [rows, per_row], placed like it."""
    from torch.distributed.tensor import DTensor

    rows = like.to_local().shape[0] if like.dim() else 1
    return DTensor.from_local(torch.zeros(rows, per_row), like.device_mesh, like.placements,
                              shape=(like.shape[0], per_row), stride=(per_row, 1), run_check=False)


def unplace(q: dict) -> dict:
    """A qstate dict with local, flat codes and scales (what the step kernels and decoders take)."""
    if not is_dtensor(q.get("codes")):
        return q
    return {**q, "codes": q["codes"].to_local().view(-1), "absmax": q["absmax"].to_local().view(-1),
            "shape": tuple(q["codes"].to_local().shape)}


def row_layout(q: dict) -> dict:
    """A plain qstate (flat codes and scales, as one process keeps them) in the row layout a DTensor's
    qstate has: codes of the tensor's shape, scales ``[rows, row / block_size]`` (views, no copy). Saved
    this way, a DCP folder loads at any world size. Unchanged when the rows are not whole blocks, and for
    4-bit codes (two per byte: no code per element to lay out)."""
    shape = tuple(q["shape"])
    if is_dtensor(q["codes"]) or not shape or 0 in shape or q.get("bits", 8) != 8:
        return q
    row = q["codes"].numel() // shape[0]
    if row % q["block_size"] or q["absmax"].numel() != shape[0] * (row // q["block_size"]):
        return q
    return {**q, "codes": q["codes"].view(shape), "absmax": q["absmax"].view(shape[0], row // q["block_size"])}


def quantize(t, key: str, block_size: int, bits: int = 8) -> dict:
    """fp32 state ``t`` (a tensor, or a DTensor: quantized shard by shard and placed like it) -> qstate.
    DTensors take 8-bit codes only (the layout above keeps a code per element)."""
    if bits != 8 and is_dtensor(t):
        raise UsageError(f"{bits}-bit state is not supported for DTensor (FSDP2) parameters; use bits=8")
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
    if not plan.ratio_fits(local(m), local(v), eps):  # the ratio would overflow fp32: m on its own
        out["exp_avg"] = quantize(m, "exp_avg", block_size, bits)
    else:
        q = quant.quantize_ratio(local(m).float(), local(v).float(), eps, block_size, bits=bits)
        out["exp_avg"] = place(q, m) if is_dtensor(m) else q
    return {k: out[k] for k in dense}
