"""What is inside a checkpoint: a torch.save file (what convert would do) or a converted file."""

from __future__ import annotations

import functools
import os
from collections import defaultdict
from typing import Any

import torch

from ..codec import checkpoint, foreign, ops, plan, policy, quant, tree
from . import folder_run, pipeline
from .. import format
from ..deepspeed import zero, info as zero_info
from ..errors import UsageError


def _role_row() -> dict:
    return {"tensors": 0, "elements": 0, "fp32_bytes": 0, "stored_bytes": 0}


def info(path: str, *, key: str | None = None, min_size: int = policy.DEFAULT_MIN_SIZE,
         block_size: int | None = None, trust: bool = False, bits: int = 8) -> dict:
    """A JSON-able report. For a converted file: roles, sizes, savings, options used. For a torch
    checkpoint: its optimizers and what ``convert`` with these options (``bits``, ``block_size``: default
    256 for 8 bits, 128 for 4) would store."""
    block_size = policy.default_block_size(bits) if block_size is None else block_size
    if zero.is_zero_checkpoint(path):
        pipeline.not_yet_for("DeepSpeed checkpoints", bits=bits)
        return zero_info.info(path, min_size=min_size, block_size=block_size)
    if checkpoint.is_dcp_folder(path):
        from ..dcp import folder as dcp_folder

        pipeline.not_yet_for("DCP folders", bits=bits)
        return dcp_folder.info(path, min_size=min_size, block_size=block_size)
    if folder_run.is_checkpoint_folder(path):  # Trainer / accelerate / Lightning folders (ckptq.folders)
        return folder_run.info(path, functools.partial(info, key=key, min_size=min_size, block_size=block_size,
                                                       trust=trust, bits=bits))
    if os.path.isdir(path) or path.endswith((format.SUFFIX, ".json")) or format.is_safetensors(path):
        return _info_converted(path)
    policy.check_block_size(block_size)
    if min_size < 1:
        raise UsageError(f"min size {min_size} must be at least 1")
    return _info_torch(path, key, min_size, block_size, trust, bits)


def _info_converted(path: str) -> dict:
    conv = tree.Converted(path, verify=False)
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


def _info_torch(path: str, key: str | None, min_size: int, block_size: int, trust: bool, bits: int) -> dict:
    """What ``convert`` with these options would store: the same plan (``pipeline.mark_states``), and the
    sizes of exactly the tensors its writer would write (quantized states are not computed)."""
    obj = checkpoint.load_torch(path, trust=trust)
    already = quant.count_qstates(obj)
    report = pipeline.ConvertReport(path, [], os.path.getsize(path), 0)
    report.foreign_states = foreign.to_torch(obj)
    marked = pipeline.mark_states(obj, key, block_size, min_size, "auto", "cpu", report, bits)
    roles: dict[str, dict] = defaultdict(_role_row)
    for d in marked.quantized:
        row = roles[d.key]
        row["tensors"] += 1
        row["elements"] += d.tensor.numel()
        row["fp32_bytes"] += d.tensor.numel() * d.tensor.element_size()
        width = plan.convert_width(d, bits)
        row["stored_bytes"] += ops.code_bytes(d.tensor.numel(), width) + 4 * ops.num_blocks(d.tensor.numel(), block_size)
    skeleton, stored = tree.flatten(obj)
    exact = _role_row()
    for s in stored:
        if s.role in ("exact", "codebook"):
            exact["tensors"] += 1
            exact["stored_bytes"] += s.nbytes
    meta = pipeline.convert_info(report, block_size, min_size, bits) | {"stored_bytes": sum(s.nbytes for s in stored)}
    estimate = format.planned_bytes(skeleton, stored, meta)
    found = ", ".join("/".join(map(str, f.path)) or "<root>" for f in marked.optimizers)
    note = None if report.quantized or not marked.optimizers else pipeline.nothing_to_quantize(marked, min_size)
    if report.foreign_states:
        note = (f"{report.foreign_states} parameters hold bitsandbytes/torchao 8-bit state: convert re-encodes "
                "it as ckptq's, expand turns it into torch AdamW's fp32 state")
    if already:
        note = (f"holds {already} ckptq 8-bit states already (e.g. saved from AdamW8bit): `ckptq expand` turns them "
                "into fp32 state; AdamW8bit.load_state_dict and ckptq.load read them as they are")
    return {"kind": "torch", "path": path, "bytes": report.source_bytes,
            "optimizers": found or "no optimizer state dict found", "options": {"min_size": min_size,
            "block_size": block_size, "bits": bits, "key": key}, "quantized": dict(roles), "exact": exact,
            "estimated_bytes": estimate, "estimated_ratio": report.source_bytes / max(estimate, 1),
            "already_8bit": already, "foreign_8bit": report.foreign_states, "warnings": report.warnings + ([note] if note else [])}
