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

import torch

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # a torch built without distributed
    DTensor = None


def is_dtensor(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def row_aligned(p, block_size: int) -> bool:
    """Whether a DTensor parameter can hold 8-bit state: sharded on dim 0 only, rows of whole blocks."""
    if p.dim() == 0 or any(not (isinstance(pl, Replicate) or pl == Shard(0)) for pl in p.placements):
        return False
    return (p.numel() // p.shape[0]) % block_size == 0


def local(t):
    """The local shard of a DTensor (shares its storage), a plain tensor as it is."""
    return t.to_local() if is_dtensor(t) else t


def place(q: dict, like) -> dict:
    """A qstate dict quantized from ``like.to_local()`` (flat codes and scales) with its codes and scales
    turned into DTensors placed like the DTensor ``like``."""
    rows = like.to_local().shape[0] if like.dim() else 1
    per_row = (like.numel() // like.shape[0]) // q["block_size"]
    codes = DTensor.from_local(q["codes"].view(like.to_local().shape), like.device_mesh, like.placements,
                               shape=like.shape, stride=like.stride(), run_check=False)
    absmax = DTensor.from_local(q["absmax"].view(rows, per_row), like.device_mesh, like.placements,
                                shape=(like.shape[0], per_row), stride=(per_row, 1), run_check=False)
    return {**q, "codes": codes, "absmax": absmax, "shape": tuple(like.shape)}


def unplace(q: dict) -> dict:
    """A qstate dict with local, flat codes and scales (what the step kernels and decoders take)."""
    if not is_dtensor(q.get("codes")):
        return q
    return {**q, "codes": q["codes"].to_local().view(-1), "absmax": q["absmax"].to_local().view(-1),
            "shape": tuple(q["codes"].to_local().shape)}
