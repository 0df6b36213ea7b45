"""Where a DTensor's state lives: the local shard, placing row-layout qstates like a parameter, and back.

``torch.distributed.tensor`` is imported only by the functions that build DTensors (no DTensor can exist before
the caller imported it). The layout rules are in ``ckptq.codec.sharded``, the quantizing there too.
"""

from __future__ import annotations

import math
import sys

import torch


def is_dtensor(t) -> bool:
    # No DTensor exists before torch.distributed.tensor is imported, so ckptq never imports it itself
    # (it costs ~50 MB and half a second on every CLI start).
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def shardable(p) -> bool:
    """Whether a DTensor parameter can hold low-bit state: 2 or more dims, replicated or sharded on dim 0 only
    (FSDP2's ``Shard(0)``, HSDP, and FSDP2 over tensor parallelism's dim-0 shards, ``_StridedShard(0)``): every
    rank then holds whole rows, whatever rows they are."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return p.dim() >= 2 and all(pl.is_replicate() or pl.is_shard(0) or (isinstance(pl, _StridedShard) and pl.dim == 0)
                                for pl in p.placements)


def local(t):
    """The local shard of a DTensor (shares its storage), a plain tensor as it is."""
    return t.to_local() if is_dtensor(t) else t


def place(q: dict, like) -> dict:
    """A qstate dict quantized from ``like.to_local()`` (row layout: codes [local rows, row_bytes], scales
    [local rows, blocks per row]) with codes and scales turned into DTensors placed like ``like``."""
    from torch.distributed.tensor import DTensor

    codes = DTensor.from_local(q["codes"], like.device_mesh, like.placements, shape=(like.shape[0], q["codes"].shape[1]),
                               stride=(q["codes"].shape[1], 1), run_check=False)
    absmax = rows_like(like, q["absmax"].shape[1])
    absmax.to_local().copy_(q["absmax"])
    return {**q, "codes": codes, "absmax": absmax, "shape": tuple(like.shape)}


def rows_like(like, width: int, dtype: torch.dtype = torch.float32):
    """Zeros of ``[rows, width]`` placed like the DTensor ``like`` (its rows on the ranks that hold them): the
    codes or scales of a qstate of ``like``."""
    from torch.distributed.tensor import DTensor

    rows = like.to_local().shape[0] if like.dim() else 1
    return DTensor.from_local(torch.zeros(rows, width, dtype=dtype, device=like.device), like.device_mesh,
                              like.placements, shape=(like.shape[0], width), stride=(width, 1), run_check=False)


def unplace(q: dict) -> dict:
    """A qstate dict with its local codes and scales and the local shape (what the kernels and decoders take)."""
    if not is_dtensor(q.get("codes")):
        return q
    codes = q["codes"].to_local()
    rows = codes.shape[0]
    return {**q, "codes": codes, "absmax": q["absmax"].to_local(), "shape": (rows, *tuple(q["shape"])[1:])}


def _local_box(like) -> tuple[tuple, tuple]:
    """(local shape, global offset) of this rank's shard of the DTensor ``like``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    return tuple(shape), tuple(offset)


def distribute_like(t, like):
    """A plain tensor holding the whole of a DTensor ``like``'s values (as every rank loaded it) as a DTensor
    placed like ``like``, from this rank's part (no communication); anything else as it is."""
    if not is_dtensor(like) or is_dtensor(t):
        return t
    from torch.distributed.tensor import DTensor

    shape, offset = _local_box(like)
    part = t[tuple(slice(o, o + n) for o, n in zip(offset, shape))].contiguous()
    return DTensor.from_local(part, like.device_mesh, like.placements, shape=like.shape, stride=like.stride(),
                              run_check=False)


def place_rows(q: dict, like) -> dict:
    """A plain qstate of the whole tensor in the row layout (as one process saves it) as the qstate of the
    ``shardable`` DTensor ``like``: this rank's rows of codes and scales, placed like it, bit for bit."""
    shape, offset = _local_box(like)
    rows = slice(offset[0], offset[0] + shape[0])
    return place({**q, "codes": q["codes"][rows].contiguous(), "absmax": q["absmax"][rows].contiguous()}, like)


def zeros_with_rows_of(rows, shape: tuple, dtype: torch.dtype = torch.float32):
    """Zeros of ``shape`` with the rows (dim 0) of ``rows`` on this rank, placed like it when it is a DTensor
    (the codes of a qstate: a dense moment that loads into those rows), a plain tensor otherwise."""
    if not is_dtensor(rows):
        return torch.zeros(shape, dtype=dtype, device=rows.device)
    from torch.distributed.tensor import DTensor

    local = torch.zeros((rows.to_local().shape[0], *shape[1:]), dtype=dtype, device=rows.device)
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(local, rows.device_mesh, rows.placements, shape=shape, stride=stride, run_check=False)
