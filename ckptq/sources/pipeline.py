"""convert / expand / load / save: orchestration only (no math, no bytes)."""

from __future__ import annotations

import functools
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from .. import __version__
from ..codec import checkpoint, foreign, plan, policy, quant, tree
from . import folder_run, readback
from .. import format
from ..format import torch_stream
from ..deepspeed import zero
from ..errors import InputError, UsageError

Progress = Callable[[int, int], None]  # (bytes done, bytes total)
DEFAULT_MIN_SIZE = policy.DEFAULT_MIN_SIZE
# Like transformers' save_pretrained: files stay easy to move, upload (hubs cap single files) and
# re-read in parallel; a checkpoint under this size is one file.
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9


@dataclass
class ConvertReport:
    source: str
    outputs: list[str]
    source_bytes: int
    output_bytes: int
    optimizers: int = 0
    quantized: int = 0  # state tensors stored 8-bit
    kept_small: int = 0  # float states below min_size, stored exact
    kept_nonfinite: int = 0  # states holding NaN/Inf, stored exact
    kept_shared: int = 0  # states sharing storage with another tensor, stored exact
    nonfinite_names: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # states kept exact, or not stored as ratios, and why
    foreign_states: int = 0  # parameters whose state was bitsandbytes' or torchao's 8-bit state
    seconds: float = 0.0
    removed: list[str] = field(default_factory=list)  # originals deleted (--replace) once the outputs checked out

    @property
    def ratio(self) -> float:
        return self.source_bytes / max(self.output_bytes, 1)

    def as_dict(self) -> dict:
        return asdict(self) | {"ratio": self.ratio}


def not_yet_for(what: str, *, replace: bool = False, bits: int = 8) -> None:
    """UsageError for the options some inputs do not take yet (--replace, 4 bits)."""
    if replace:
        raise UsageError(f"--replace is not available for {what} yet; convert or expand without it, "
                         "check the result, then delete the originals yourself")
    if bits != 8:
        raise UsageError(f"{bits}-bit state is not supported for {what} yet; convert them with --bits 8")


def default_output(src: str, bits: int = 8) -> str:
    """``ckpt.pt`` -> ``ckpt.q8.safetensors`` (``ckpt.q4.safetensors`` for 4 bits; ``ckpt.q8.safetensors``
    -> ``ckpt.q4.safetensors``), beside the input."""
    base = os.path.basename(src.rstrip("/")).removesuffix(format.INDEX_SUFFIX)
    stem = base.rsplit(".", 1)[0] if "." in base else base
    stem = stem.removesuffix(".q8").removesuffix(".q4")
    return os.path.join(os.path.dirname(src), f"{stem}.q{bits}{format.SUFFIX}")


def default_expanded(src: str) -> str:
    """``ckpt.q8.safetensors`` -> ``ckpt.fp32.pt``; ``optimizer.pt`` (a torch.save file) -> ``optimizer.fp32.pt``."""
    base = os.path.basename(src.rstrip("/"))
    for suffix in (format.INDEX_SUFFIX, format.SUFFIX, ".pt", ".pth", ".bin"):
        base = base.removesuffix(suffix)
    return os.path.join(os.path.dirname(src), base.removesuffix(".q8").removesuffix(".q4") + ".fp32.pt")


def mark_states(obj: Any, key: str | None, block_size: int, min_size: int, backend: str, device: str,
                report: ConvertReport, bits: int = 8) -> plan.Plan:
    """Replace each optimizer state tensor the plan stores 8-bit (or 4-bit) by a lazy PendingQuant, in
    place; fill the report's counts. ``info`` runs the same, so that it shows what convert would do."""
    p = plan.make_plan(obj, key, min_size)
    for d in p.quantized:
        _node(obj, d.path)[d.key] = tree.PendingQuant(d.tensor, d.key, block_size, backend, divisor=d.divisor,
                                                      device=device, bits=plan.convert_width(d, bits))
    report.optimizers = len(p.optimizers)
    report.quantized = len(p.quantized)
    report.kept_small = len(p.kept("below min_size"))
    report.kept_shared = len(p.kept("shares storage"))
    report.kept_nonfinite = len(p.kept("holds NaN/Inf"))
    report.nonfinite_names = [d.name for d in p.kept("holds NaN/Inf")]
    report.warnings = p.warnings()
    return p


def _node(obj: Any, path: tuple) -> Any:
    for k in path:
        obj = obj[k]
    return obj


def nothing_to_quantize(p: plan.Plan, min_size: int) -> str:
    """Why a plan stores nothing 8-bit, and what to do."""
    reasons = Counter(d.exact for d in p.decisions)
    if set(reasons) <= {"not an Adam moment"}:
        keys = sorted({d.key for d in p.decisions})
        return (f"the optimizer state holds no Adam moments to store 8-bit (found: {', '.join(keys) or 'no tensors'}); "
                "ckptq converts Adam/AdamW state (exp_avg, exp_avg_sq), nothing else")
    why = ", ".join(f"{n} {r}" for r, n in sorted(reasons.items()) if r != "not an Adam moment")
    hint = f"; lower --min-size (now {min_size})" if reasons.get("below min_size") else ""
    return f"none of the Adam moments can be stored 8-bit ({why}){hint}"


def _not_the_input(src: str, dst: str) -> None:
    if os.path.realpath(dst) == os.path.realpath(src):
        raise UsageError(f"output {dst} is the input; choose another -o path")


def convert(
    src: str,
    dst: str | None = None,
    *,
    bits: int = 8,
    block_size: int | None = None,
    min_size: int = DEFAULT_MIN_SIZE,
    key: str | None = None,
    device: str = "auto",
    backend: str = "auto",
    compression: format.Compression | None = None,
    max_shard_size: int | None = DEFAULT_MAX_SHARD_SIZE,
    force: bool = False,
    trust: bool = False,
    replace: bool = False,
    progress: Progress | None = None,
) -> ConvertReport:
    """Convert a torch.save checkpoint's fp32 optimizer states to blockwise 8-bit codes (``bits=4``: 4 bits per
    value, a 6-bit ratio over a 2-bit second moment, ``policy.convert_width``);
    write safetensors. A converted ckptq file as ``src`` is decoded and re-encoded at ``bits`` (8 <-> 4). A
    Trainer / accelerate / Lightning checkpoint folder: its optimizer files, each beside its original.
    ``block_size``: values per scale (default 256 for 8 bits, 128 for 4).

    Returns a :class:`ConvertReport`. The output appears only complete. The input is never modified, and
    kept unless ``replace``: then it is deleted once the output was written, synced, read back and checked."""
    t0 = time.perf_counter()
    block_size = policy.default_block_size(bits) if block_size is None else block_size
    policy.check_block_size(block_size)
    if min_size < 1:
        raise UsageError(f"min size {min_size} must be at least 1")
    if zero.is_zero_checkpoint(src):
        not_yet_for("DeepSpeed checkpoints", replace=replace, bits=bits)
        return ConvertReport(**zero.convert(src, dst, block_size=block_size, min_size=min_size, force=force, progress=progress))
    if checkpoint.is_dcp_folder(src):
        not_yet_for("DCP folders", bits=bits)
        folder_run.no_dcp_replace([src], replace)
        return _convert_dcp(src, dst, block_size, min_size, force, t0)
    if os.path.isdir(src):  # Trainer / accelerate / Lightning checkpoint folders (ckptq.folders)
        one = functools.partial(convert, bits=bits, block_size=block_size, min_size=min_size, key=key, device=device,
                                backend=backend, compression=compression, max_shard_size=max_shard_size,
                                force=force, trust=trust, progress=progress)
        return _folder_report(src, *folder_run.convert(src, dst, one, replace=replace, trust=trust), t0)
    return _convert_file(src, dst or default_output(src, bits), bits, block_size, min_size, key, device, backend,
                         compression, max_shard_size, force, trust, replace, progress, t0)


def _convert_file(src, dst, bits, block_size, min_size, key, device, backend, compression, max_shard_size,
                  force, trust, replace, progress, t0) -> ConvertReport:
    """``convert`` of one torch.save file, or of a converted file (re-encoded at ``bits``)."""
    _not_the_input(src, dst)
    if compression is not None and not (1 <= compression.level <= 22 and compression.threads >= 0):
        raise UsageError(f"compression level {compression.level} / threads {compression.threads}: use a level "
                         "from 1 to 22 and threads >= 0 (0 = all cores)")
    device = _quant_device(device)
    if format.is_safetensors(src):  # a converted file (8 <-> 4 bits): its states decoded to their dtype
        obj = _read_converted(src, bits)
    else:  # memory-mapped on the CPU; states visit `device` one at a time
        obj = checkpoint.load_torch(src, trust=trust)
    report = ConvertReport(src, [], os.path.getsize(src), 0)
    report.foreign_states = foreign.to_torch(obj)  # bitsandbytes / torchao 8-bit state, decoded first
    marked = mark_states(obj, key, block_size, min_size, backend, device, report, policy.check_budget(bits))
    if report.optimizers == 0:
        raise InputError(f"{src}: no optimizer state dict (a dict with 'state' and 'param_groups') found; "
                         "name it with --key if it is stored differently")
    if not report.quantized:
        raise InputError(f"{src}: {nothing_to_quantize(marked, min_size)}")
    info = convert_info(report, block_size, min_size, bits)
    report.outputs = save(obj, dst, info=info, force=force, compression=compression,
                          max_shard_size=max_shard_size, progress=progress)
    report.output_bytes = sum(os.path.getsize(p) for p in report.outputs)
    if replace:  # the original goes only once the output reads back as what was meant
        report.removed = readback.replace_converted(src, report.outputs, trust)
    report.seconds = time.perf_counter() - t0
    return report


def _folder_report(src: str, layout, reports: list[ConvertReport], removed: list[str], t0: float) -> ConvertReport:
    """One report for a checkpoint folder's files."""
    total = ConvertReport(src, [p for r in reports for p in r.outputs], sum(r.source_bytes for r in reports),
                          sum(r.output_bytes for r in reports), removed=removed)
    for name in ("optimizers", "quantized", "kept_small", "kept_nonfinite", "kept_shared", "foreign_states"):
        setattr(total, name, sum(getattr(r, name) for r in reports))
    total.nonfinite_names = [n for r in reports for n in r.nonfinite_names]
    total.warnings = [w for r in reports for w in r.warnings]
    total.seconds = time.perf_counter() - t0
    return total


def _widths(node: Any) -> set:
    """The code widths of the quantized nodes in a converted file's skeleton."""
    if isinstance(node, dict):
        q = node.get("quantized")
        return {q.get("bits")} if isinstance(q, dict) else set().union(*map(_widths, node.values()))
    return set().union(*map(_widths, node)) if isinstance(node, list) else set()


def _read_converted(src: str, bits: int) -> Any:
    """A converted file's contents with its states decoded, to be re-encoded at ``bits``; InputError if
    they already have that width (quantizing them again would only add rounding)."""
    conv = tree.Converted(src)
    if policy.budget_of(_widths(conv.skeleton)) == bits:
        other = 4 if bits == 8 else 8
        raise InputError(f"{src} already holds {bits}-bit states; `ckptq convert --bits {other}` re-encodes them "
                         f"at {other} bits, `ckptq expand` turns them back into fp32")
    return conv.read(dequantize=True)


def _convert_dcp(src: str, dst: str | None, block_size: int, min_size: int, force: bool, t0: float) -> ConvertReport:
    """A torch.distributed.checkpoint folder -> a DCP folder with 8-bit Adam moments (``ckptq.dcp_folder``)."""
    from ..dcp import folder as dcp_folder  # imports torch.distributed.checkpoint: only when a folder needs it

    dst = dst or src.rstrip("/") + ".q8"
    _not_the_input(src, dst)
    r = dcp_folder.convert(src, dst, block_size=block_size, min_size=min_size, force=force)
    report = ConvertReport(src, [dst], r["source_bytes"], r["output_bytes"], quantized=r["quantized"],
                           warnings=r["warnings"])
    report.seconds = time.perf_counter() - t0
    return report


def convert_info(report: ConvertReport, block_size: int, min_size: int, bits: int = 8) -> dict:
    """The ``ckptq.info`` metadata of a converted file (``save`` adds ``stored_bytes``); ``bits`` only when 4."""
    return {"created_by": f"ckptq {__version__}", "source": os.path.basename(report.source),
            "source_bytes": report.source_bytes, "block_size": block_size, "min_size": min_size,
            "quantized": report.quantized} | ({"bits": bits} if bits != 8 else {})


def _quant_device(device: str) -> str:
    if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
        raise UsageError(f"device {device!r} is not one of auto, cpu, cuda")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but no CUDA device is available; use --device cpu")
    return device


def save(
    obj: Any,
    path: str,
    *,
    info: dict | None = None,
    force: bool = False,
    compression: format.Compression | None = None,
    max_shard_size: int | None = None,
    progress: Progress | None = None,
) -> list[str]:
    """Write any checkpoint structure (tensors, qstate dicts, containers, scalars) in ckptq format.

    Quantized states (e.g. from ``AdamW8bit.state_dict()``) are stored as they are; returns the paths written.
    """
    skeleton, stored = tree.flatten(obj)
    total, done = sum(s.nbytes for s in stored), 0

    def on_tensor(s: tree.Stored) -> None:
        nonlocal done
        done += s.nbytes
        if progress:
            progress(done, total)

    info = dict(info or {"created_by": f"ckptq {__version__}"})
    info["stored_bytes"] = total
    return format.write(path, skeleton, stored, info, force=force, compression=compression,
                        max_shard_size=max_shard_size, on_tensor=on_tensor)


def load(path: str, *, dequantize: bool = False, verify: bool = True) -> Any:
    """Read a converted checkpoint (file, index, or folder). Quantized states stay qstate dicts (what
    ``ckptq.optim.AdamW8bit.load_state_dict`` takes) unless ``dequantize=True``. A torch.save file (e.g. an
    ``optimizer.pt`` that Trainer wrote from AdamW8bit's state) is read with ``torch.load(weights_only=True)``."""
    if checkpoint.is_torch_file(path):
        obj = checkpoint.load_torch(path)
        if dequantize:
            quant.decode_qstates(obj)
        return obj
    return tree.Converted(path, verify).read(dequantize)


@dataclass
class ExpandReport:
    source: str
    output: str  # a checkpoint folder: its outputs, comma-separated
    output_bytes: int
    seconds: float
    removed: list[str] = field(default_factory=list)  # converted files deleted (--replace) once the output checked out


def expand(src: str, dst: str | None = None, *, force: bool = False, verify: bool = True, trust: bool = False,
           replace: bool = False, progress: Progress | None = None) -> ExpandReport:
    """Converted file -> ordinary torch.save checkpoint with fp32 (original dtype) states. A Trainer /
    accelerate / Lightning checkpoint folder: its converted files -> the files the framework's resume reads.
    ``replace``: the source is deleted once the output was written, synced, read back and checked."""
    t0 = time.perf_counter()
    if zero.is_zero_checkpoint(src):
        not_yet_for("DeepSpeed checkpoints", replace=replace)
        return ExpandReport(**zero.expand(src, dst, force=force, verify=verify, progress=progress))
    one = functools.partial(expand, force=force, verify=verify, trust=trust, progress=progress)
    if folder_run.is_checkpoint_folder(src):  # Trainer / accelerate / Lightning folders (ckptq.folders)
        layout, reports, removed = folder_run.expand(src, dst, one, replace=replace, trust=trust)
        return ExpandReport(src, ", ".join(r.output for r in reports), sum(r.output_bytes for r in reports),
                            time.perf_counter() - t0, removed)
    if replace:
        return _expand_replacing(src, dst, one, trust)
    if checkpoint.is_dcp_folder(src):
        from ..dcp import folder as dcp_folder

        r = dcp_folder.expand(src, dst or src.rstrip("/") + ".fp32", force=force)
        return ExpandReport(src, r["output"], r["output_bytes"], time.perf_counter() - t0)
    dst = dst or default_expanded(src)
    if checkpoint.is_torch_file(src):
        return _expand_torch(src, dst, force, trust, progress, t0)
    conv = tree.Converted(src, verify)
    for f in conv.files:
        _not_the_input(f, dst)
    obj = conv.read(dequantize=True, lazy=True)  # tensors are produced one at a time while writing
    with format.atomic_outputs([dst], force, "torch") as (tmp,):
        torch_stream.save(obj, tmp, progress)
    conv.close()
    return ExpandReport(src, dst, os.path.getsize(dst), time.perf_counter() - t0)


def _expand_replacing(src: str, dst: str | None, expand_one, trust: bool) -> ExpandReport:
    folder_run.no_dcp_replace([src], True)
    files = [src] if checkpoint.is_torch_file(src) else folder_run.files_of(src)
    report = expand_one(src, dst)
    readback.check_expanded(src, report.output, trust)
    for f in files:
        readback.remove_original(f, [report.output])
    report.removed = files
    return report


def _expand_torch(src: str, dst: str, force: bool, trust: bool, progress: Progress | None, t0: float) -> ExpandReport:
    """A torch.save file holding 8-bit states (Trainer or accelerate saving AdamW8bit's state dict; a
    bitsandbytes or torchao optimizer's): the same file with every state decoded to torch's fp32 form."""
    _not_the_input(src, dst)
    obj = checkpoint.load_torch(src, trust=trust)
    if not quant.count_qstates(obj) + foreign.to_torch(obj):
        raise InputError(f"{src} is a torch.save checkpoint without 8-bit states (ckptq, bitsandbytes or torchao): "
                         "it is already expanded (torch.load reads it; `ckptq convert` shrinks it)")
    quant.decode_qstates(obj)
    with format.atomic_outputs([dst], force, "torch") as (tmp,):
        torch_stream.save(obj, tmp, progress)
    return ExpandReport(src, dst, os.path.getsize(dst), time.perf_counter() - t0)
