"""convert / expand / load / save: orchestration only (no math, no bytes)."""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from . import __version__, checkpoint, format, ops, qstate, torch_stream, tree
from .errors import InputError, UsageError

Progress = Callable[[int, int], None]  # (bytes done, bytes total)
DEFAULT_MIN_SIZE = 4096
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
    seconds: float = 0.0

    @property
    def ratio(self) -> float:
        return self.source_bytes / max(self.output_bytes, 1)

    def as_dict(self) -> dict:
        return asdict(self) | {"ratio": self.ratio}


def default_output(src: str) -> str:
    """``ckpt.pt`` -> ``ckpt.q8.safetensors`` (beside the input)."""
    base = os.path.basename(src.rstrip("/"))
    stem = base.rsplit(".", 1)[0] if "." in base else base
    return os.path.join(os.path.dirname(src), stem + ".q8" + format.SUFFIX)


def default_expanded(src: str) -> str:
    """``ckpt.q8.safetensors`` -> ``ckpt.fp32.pt``."""
    base = os.path.basename(src.rstrip("/"))
    for suffix in (format.INDEX_SUFFIX, format.SUFFIX):
        base = base.removesuffix(suffix)
    return os.path.join(os.path.dirname(src), base.removesuffix(".q8") + ".fp32.pt")


def _mark_states(obj: Any, key: str | None, block_size: int, min_size: int, backend: str, device: str,
                 report: ConvertReport) -> None:
    """Replace each quantizable optimizer state tensor by a lazy PendingQuant, in place."""
    shared = checkpoint.shared_storages(obj)
    found = checkpoint.find_optimizers(obj, key)
    report.optimizers = len(found)
    for f in found:
        groups = {pid: g for g in f.state_dict["param_groups"] if isinstance(g, dict) for pid in g.get("params", [])}
        for pid, pstate in f.state_dict["state"].items():
            if not isinstance(pstate, dict):
                continue
            _mark_param(pstate, groups.get(pid, {}), f.path + ("state", pid), block_size, min_size, backend,
                        device, shared, report)
        report.quantized += sum(isinstance(v, tree.PendingQuant) for st in f.state_dict["state"].values()
                                if isinstance(st, dict) for v in st.values())


def _mark_param(pstate: dict, group: dict, path: tuple, block_size: int, min_size: int, backend: str,
                device: str, shared: set, report: ConvertReport) -> None:
    for name, t in list(pstate.items()):
        if not isinstance(t, torch.Tensor) or name == "step" or not t.is_floating_point():
            continue
        if not checkpoint.is_quantizable(t, min_size):
            report.kept_small += 1
        elif checkpoint.storage_key(t) in shared:
            report.kept_shared += 1
        elif not _all_finite(t):
            report.kept_nonfinite += 1
            report.nonfinite_names.append("/".join(map(str, path + (name,))))
        else:
            pstate[name] = tree.PendingQuant(t, name, block_size, backend, device=device)
    # a first moment whose second moment is quantized too is stored relative to it (qstate docstring)
    for m_key, v_key in qstate.RATIO_PAIRS.items():
        m, v = pstate.get(m_key), pstate.get(v_key)
        if isinstance(m, tree.PendingQuant) and isinstance(v, tree.PendingQuant) and m.tensor.shape == v.tensor.shape:
            m.divisor = (v_key, v.tensor, qstate.ratio_eps_for(group, pstate.get("step", 0)))


def _not_the_input(src: str, dst: str) -> None:
    if os.path.realpath(dst) == os.path.realpath(src):
        raise UsageError(f"output {dst} is the input; choose another -o path")


def _all_finite(t: torch.Tensor) -> bool:
    # min and max propagate NaN and reach +-Inf: one reduction pass, no full-size bool temporary
    lo, hi = torch.aminmax(t.detach().reshape(-1))
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def convert(
    src: str,
    dst: str | None = None,
    *,
    block_size: int = ops.DEFAULT_BLOCK_SIZE,
    min_size: int = DEFAULT_MIN_SIZE,
    key: str | None = None,
    device: str = "auto",
    backend: str = "auto",
    compression: format.Compression | None = None,
    max_shard_size: int | None = DEFAULT_MAX_SHARD_SIZE,
    force: bool = False,
    trust: bool = False,
    progress: Progress | None = None,
) -> ConvertReport:
    """Convert a torch.save checkpoint's fp32 optimizer states to blockwise 8-bit; write safetensors.

    Returns a :class:`ConvertReport`. The input is never modified; the output appears only complete.
    """
    t0 = time.perf_counter()
    ops.check_block_size(block_size)
    if min_size < 1:
        raise UsageError(f"min size {min_size} must be at least 1")
    dst = dst or default_output(src)
    _not_the_input(src, dst)
    if compression is not None and not (1 <= compression.level <= 22 and compression.threads >= 0):
        raise UsageError(f"compression level {compression.level} / threads {compression.threads}: use a level "
                         "from 1 to 22 and threads >= 0 (0 = all cores)")
    if format.is_safetensors(src):
        raise InputError(f"{src} is a safetensors file; convert takes torch.save checkpoints "
                         "(for a converted file use `ckptq info` or `ckptq expand`)")
    device = _quant_device(device)
    obj = checkpoint.load_torch(src, trust=trust)  # memory-mapped on the CPU; states visit `device` one at a time
    report = ConvertReport(src, [], os.path.getsize(src), 0)
    _mark_states(obj, key, block_size, min_size, backend, device, report)
    if report.optimizers == 0:
        raise InputError(f"{src}: no optimizer state dict (a dict with 'state' and 'param_groups') found; "
                         "name it with --key if it is stored differently")
    info = {"created_by": f"ckptq {__version__}", "source": os.path.basename(src), "source_bytes": report.source_bytes,
            "block_size": block_size, "min_size": min_size, "quantized": report.quantized}
    report.outputs = save(obj, dst, info=info, force=force, compression=compression,
                          max_shard_size=max_shard_size, progress=progress)
    report.output_bytes = sum(os.path.getsize(p) for p in report.outputs)
    report.seconds = time.perf_counter() - t0
    return report


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
    ``ckptq.optim.AdamW8bit.load_state_dict`` takes) unless ``dequantize=True``."""
    return format.Converted(path, verify).read(dequantize)


@dataclass
class ExpandReport:
    source: str
    output: str
    output_bytes: int
    seconds: float


def expand(src: str, dst: str | None = None, *, force: bool = False, verify: bool = True,
           progress: Progress | None = None) -> ExpandReport:
    """Converted file -> ordinary torch.save checkpoint with fp32 (original dtype) states."""
    t0 = time.perf_counter()
    dst = dst or default_expanded(src)
    conv = format.Converted(src, verify)
    for f in conv.files:
        _not_the_input(f, dst)
    obj = conv.read(dequantize=True, lazy=True)  # tensors are produced one at a time while writing
    with format.atomic_outputs([dst], force) as (tmp,):
        torch_stream.save(obj, tmp, progress)
    conv.close()
    return ExpandReport(src, dst, os.path.getsize(dst), time.perf_counter() - t0)
