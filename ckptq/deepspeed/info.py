"""``ckptq info`` of a DeepSpeed ZeRO checkpoint: stage, world size, parameters, the bytes of the Adam
moments, each rank's files, and what ``convert`` would write (computed as convert plans it, to the byte)."""

from __future__ import annotations

import os

from ..codec import policy
from . import objects as zero_pickle, ranks as zero_ranks, universal as zero_universal
from .plan import INFO_KEY, converted_meta, planned_bytes
from ..errors import InputError, UsageError


def _param_count(folder: str, mp_rank: int) -> int | None:
    """Parameters of the model, from ``param_shapes`` in its model states file (None if unreadable)."""
    for name in (f"mp_rank_{mp_rank:02d}_model_states.pt", f"zero_pp_rank_0_mp_rank_{mp_rank:02d}_model_states.pt"):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        try:
            shapes = zero_pickle.load(path).get("param_shapes")
        except (InputError, AttributeError):
            return None
        groups = shapes if isinstance(shapes, (list, tuple)) else [shapes]
        return sum(int(s.numel()) for g in groups if isinstance(g, dict) for s in g.values())
    return None


def _rank_row(p: zero_ranks.Partition, block_size: int, min_size: int) -> dict:
    row = {"rank": p.rank, "mp_rank": p.mp_rank, "fp32_file": None, "fp32_bytes": 0, "q8_file": None, "q8_bytes": 0}
    if os.path.isfile(p.pt):
        obj = zero_ranks.load_partition(p.pt)
        planned = zero_ranks.plan_partition(p, obj, block_size, min_size)
        row |= {"fp32_file": os.path.basename(p.pt), "fp32_bytes": os.path.getsize(p.pt),
                "convert_would_write": planned_bytes(planned),
                "would_quantize": planned.quantized, "warnings": planned.warnings}
        row |= planned.meta[INFO_KEY]
    if os.path.isfile(p.q8):
        meta = converted_meta(p.q8)
        row |= {"q8_file": os.path.basename(p.q8), "q8_bytes": os.path.getsize(p.q8)}
        row |= {k: v for k, v in meta[INFO_KEY].items() if k not in row or row["fp32_file"] is None}
    return row


def info(path: str, *, min_size: int, block_size: int) -> dict:
    """A JSON-able description of a ZeRO save dir, ``global_stepN`` folder, rank file or universal folder."""
    policy.check_block_size(block_size)
    if min_size < 1:
        raise UsageError(f"min size {min_size} must be at least 1")
    if zero_universal.is_universal(path):
        return zero_universal.info(path, block_size=block_size, min_size=min_size)
    parts = zero_ranks.partitions(path)
    rows = [_rank_row(p, block_size, min_size) for p in parts]
    if os.path.isdir(path):
        zero_ranks.check_world(parts, {os.path.join(p.folder, p.stem): r.get("world_size") for p, r in zip(parts, rows)})
    fp32 = [r for r in rows if r["fp32_file"]]
    would = sum(r["convert_would_write"] for r in fp32)
    stages = {r.get("stage") for r in rows}
    return {"kind": "zero", "path": path, "folder": parts[0].folder, "stage": stages.pop() if len(stages) == 1 else None,
            "world_size": rows[0].get("world_size"), "mp_world_size": len({p.mp_rank for p in parts}),
            "bf16": parts[0].stem.startswith("bf16_"), "params": _param_count(parts[0].folder, parts[0].mp_rank),
            "ranks": rows, "moment_bytes": sum(r.get("moment_bytes", 0) for r in rows),
            "fp32_bytes": sum(r["fp32_bytes"] for r in rows), "q8_bytes": sum(r["q8_bytes"] for r in rows),
            "convert_would_write": would if fp32 else None,
            "convert_would_save": sum(r["fp32_bytes"] for r in fp32) - would if fp32 else None,
            "warnings": [w for r in fp32 for w in r["warnings"]]}
