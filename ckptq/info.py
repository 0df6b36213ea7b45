"""What is inside a checkpoint: a torch.save file (what convert would do) or a converted file."""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

import torch

from . import checkpoint, format
from .pipeline import DEFAULT_MIN_SIZE


def _role_row() -> dict:
    return {"tensors": 0, "elements": 0, "fp32_bytes": 0, "stored_bytes": 0}


def info(path: str, *, min_size: int = DEFAULT_MIN_SIZE, block_size: int = 256, trust: bool = False) -> dict:
    """A JSON-able report. For a converted file: roles, sizes, savings, options used. For a torch
    checkpoint: its optimizers and what ``convert`` with these options would store."""
    if os.path.isdir(path) or path.endswith((format.SUFFIX, ".json")) or format.is_safetensors(path):
        return _info_converted(path)
    return _info_torch(path, min_size, block_size, trust)


def _info_converted(path: str) -> dict:
    conv = format.Converted(path, verify=False)
    tables = conv.tensors
    roles: dict[str, dict] = defaultdict(_role_row)
    exact = _role_row()

    def stored(name: str) -> int:
        e = conv._where[name].entries[name]
        return e["data_offsets"][1] - e["data_offsets"][0]

    for key, node in _walk_skeleton(conv.skeleton, None):
        if "quantized" in node:
            q = node["quantized"]
            numel = int(torch.Size(q["shape"]).numel())
            row = roles[str(key)]
            row["tensors"] += 1
            row["elements"] += numel
            row["fp32_bytes"] += 4 * numel
            row["stored_bytes"] += stored(q["codes"]) + stored(q["absmax"])
    quantized_names = {n for r in _quantized_parts(conv.skeleton) for n in r}
    for name in tables:
        if name not in quantized_names:
            exact["tensors"] += 1
            exact["stored_bytes"] += stored(name)
    total = sum(os.path.getsize(f) for f in conv.files)
    codecs = sorted({t.get("codec", {}).get("codec", "raw") for t in tables.values()})
    conv.close()
    src = conv.info.get("source_bytes")
    return {"kind": "converted", "path": path, "files": conv.files, "format_version": conv.version,
            "options": conv.info, "quantized": dict(roles), "exact": exact, "codecs": codecs, "bytes": total,
            "source_bytes": src, "ratio": (src / total) if src else None}


def _walk_skeleton(node: Any, key: Any):
    if isinstance(node, dict):
        if "quantized" in node or "tensor" in node:
            yield key, node
            return
        for kind in ("dict", "odict"):
            for k, v in node.get(kind, []):
                yield from _walk_skeleton(v, k)
        for kind in ("list", "tuple"):
            for i, v in enumerate(node.get(kind, [])):
                yield from _walk_skeleton(v, i)


def _quantized_parts(skeleton: Any):
    for _, node in _walk_skeleton(skeleton, None):
        if "quantized" in node:
            q = node["quantized"]
            yield q["codes"], q["absmax"], q["qmap"]


def _info_torch(path: str, min_size: int, block_size: int, trust: bool) -> dict:
    obj = checkpoint.load_torch(path, trust=trust)
    found = checkpoint.find_optimizers(obj)
    roles: dict[str, dict] = defaultdict(_role_row)
    quantized_ids = set()
    for f in found:
        for pstate in f.state_dict["state"].values():
            for name, t in pstate.items() if isinstance(pstate, dict) else ():
                if name != "step" and checkpoint.is_quantizable(t, min_size) and t.is_floating_point():
                    row = roles[str(name)]
                    row["tensors"] += 1
                    row["elements"] += t.numel()
                    row["fp32_bytes"] += t.numel() * t.element_size()
                    row["stored_bytes"] += t.numel() + 4 * -(-t.numel() // block_size)
                    quantized_ids.add(id(t))
    exact = _role_row()
    seen = set()
    for t in checkpoint.iter_tensors(obj):
        k = checkpoint.storage_key(t)
        if id(t) not in quantized_ids and k not in seen:
            seen.add(k)
            exact["tensors"] += 1
            exact["stored_bytes"] += t.untyped_storage().nbytes()
    size = os.path.getsize(path)
    estimate = exact["stored_bytes"] + sum(r["stored_bytes"] for r in roles.values())
    if not found and not roles:
        opt_note = "no optimizer state dict found"
    else:
        opt_note = ", ".join("/".join(map(str, f.path)) or "<root>" for f in found)
    return {"kind": "torch", "path": path, "bytes": size, "optimizers": opt_note,
            "options": {"min_size": min_size, "block_size": block_size}, "quantized": dict(roles),
            "exact": exact, "estimated_bytes": estimate, "estimated_ratio": size / max(estimate, 1)}

