"""DeepSpeed universal checkpoints (``ds_to_universal.py`` output, what ``"load_universal": true`` resumes
from at any world size): ``zero/<param name>/{fp32,exp_avg,exp_avg_sq,step}.pt``, each moment file a dict
``{"cat_dim": ..., "param": tensor shaped like the parameter}``, plus ``zero/optimizer_state.pt``.

Convert writes one ``zero/<param>/moments.q8.safetensors`` per parameter holding both moments (the first
as a ratio to the second, so they share a file): a one-parameter optimizer state dict, so that
``ckptq.plan`` decides what goes 8-bit with the rules of any convert, with eps and betas from the first
param group of ``optimizer_state.pt`` and the step from ``step.pt``, plus each moment file's other entries.
Expand writes ``exp_avg.pt`` / ``exp_avg_sq.pt`` back. ``fp32.pt`` and ``step.pt`` are never touched.
"""

from __future__ import annotations

import os
import time

import torch

from ..codec import checkpoint, tree
from .. import format
from ..format import files, torch_stream
from . import objects as zero_pickle
from ..errors import InputError
from .plan import INFO_KEY, Q8, Planned, converted_meta, plan_tree, report, write_all

MOMENT_FILES = ("exp_avg", "exp_avg_sq")
CONVERTED = "moments" + Q8


def is_universal(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "zero", "optimizer_state.pt"))


def param_folders(path: str) -> list[str]:
    root = os.path.join(path, "zero")
    found = sorted(os.path.join(root, n) for n in os.listdir(root) if os.path.isfile(os.path.join(root, n, "fp32.pt")))
    if not found:
        raise InputError(f"{root} holds no parameter folders (<name>/fp32.pt); it is not a universal checkpoint")
    return found


def _group(path: str) -> dict:
    """eps and betas of the first param group (torch's defaults when the file does not say)."""
    sd = zero_pickle.to_plain(zero_pickle.load(os.path.join(path, "zero", "optimizer_state.pt")))
    groups = sd.get("param_groups") if isinstance(sd, dict) else None
    first = groups[0] if isinstance(groups, list) and groups and isinstance(groups[0], dict) else {}
    return {"params": [0], "eps": first.get("eps", 1e-8), "betas": tuple(first.get("betas", (0.9, 0.999)))}


def _load(path: str):
    """A file of the universal checkpoint (``weights_only``), its nesting checked: plan and the flattener
    walk it recursively."""
    obj = checkpoint.load_torch(path)
    files.check_nesting(obj, path)
    return obj


def _moment_file(folder: str, name: str) -> dict:
    obj = _load(os.path.join(folder, name + ".pt"))
    if not isinstance(obj, dict) or not isinstance(obj.get("param"), torch.Tensor):
        raise InputError(f"{folder}/{name}.pt is not a universal checkpoint moment file (a dict with 'param')")
    return obj


def _param_numel(folder: str) -> int:
    obj = _load(os.path.join(folder, "fp32.pt"))
    if not isinstance(obj, dict) or not isinstance(obj.get("param"), torch.Tensor):
        raise InputError(f"{folder}/fp32.pt is not a universal checkpoint parameter file (a dict with 'param')")
    return obj["param"].numel()


def plan_param(folder: str, group: dict, block_size: int, min_size: int) -> Planned:
    m, v = (_moment_file(folder, n) for n in MOMENT_FILES)
    step_path = os.path.join(folder, "step.pt")
    step = _load(step_path) if os.path.isfile(step_path) else 0
    obj = {"state": {0: {"step": step, "exp_avg": m["param"], "exp_avg_sq": v["param"]}}, "param_groups": [group],
           "files": {n: {k: (None if k == "param" else x) for k, x in f.items()} for n, f in zip(MOMENT_FILES, (m, v))}}
    return plan_tree(obj, os.path.join(folder, "exp_avg.pt"), block_size, min_size,
                     {"universal": os.path.basename(folder)})


def _fp32_folders(src: str) -> list[str]:
    folders = []
    for f in param_folders(src):
        have = [os.path.isfile(os.path.join(f, n + ".pt")) for n in MOMENT_FILES]
        if any(have) and not all(have):
            raise InputError(f"{f} holds {MOMENT_FILES[have.index(True)]}.pt but not "
                             f"{MOMENT_FILES[have.index(False)]}.pt; the universal checkpoint is incomplete")
        if all(have):
            folders.append(f)
    if not folders:
        raise InputError(f"{src}: no fp32 moment files (zero/<param>/exp_avg.pt) to convert; they are 8-bit "
                         "already (`ckptq expand` restores them)")
    return folders


def convert(src: str, *, block_size: int, min_size: int, force: bool = False, progress=None) -> dict:
    """Every parameter's two moment files -> ``moments.q8.safetensors`` beside them; all or none."""
    t0 = time.perf_counter()
    group = _group(src)
    folders = _fp32_folders(src)
    planned = [plan_param(f, group, block_size, min_size) for f in folders]
    if not any(pl.quantized for pl in planned):
        raise InputError(f"{src}: no parameter's moments are large enough to store 8-bit (--min-size {min_size}); "
                         "lower --min-size")
    outputs = [os.path.join(f, CONVERTED) for f in folders]
    write_all(outputs, planned, force, progress)
    sources = [os.path.join(f, n + ".pt") for f in folders for n in MOMENT_FILES]
    return report(src, outputs, sources, planned, time.perf_counter() - t0)


def expand(src: str, *, force: bool = False, verify: bool = True, progress=None) -> dict:
    """Write every parameter's ``exp_avg.pt`` / ``exp_avg_sq.pt`` back from its converted file; all or none."""
    t0 = time.perf_counter()
    folders = [f for f in param_folders(src) if os.path.isfile(os.path.join(f, CONVERTED))]
    if not folders:
        raise InputError(f"{src}: no converted moments (zero/<param>/{CONVERTED}) to expand")
    for f in folders:
        converted_meta(os.path.join(f, CONVERTED))
    finals = [os.path.join(f, n + ".pt") for f in folders for n in MOMENT_FILES]
    with files.atomic_outputs(finals, force, "torch") as tmps:
        for i, f in enumerate(folders):
            conv = tree.Converted(os.path.join(f, CONVERTED), verify)
            obj = conv.read(dequantize=True)
            for j, name in enumerate(MOMENT_FILES):
                out = {k: (obj["state"][0][name] if k == "param" else x) for k, x in obj["files"][name].items()}
                torch_stream.save(out, tmps[2 * i + j], progress)
            conv.close()
    return {"source": src, "output": os.path.join(src, "zero"), "output_bytes": sum(os.path.getsize(p) for p in finals),
            "seconds": time.perf_counter() - t0}


def info(path: str, *, block_size: int, min_size: int) -> dict:
    """A JSON-able description of a universal checkpoint folder and what convert would write."""
    folders = param_folders(path)
    group = _group(path)
    fp32 = [f for f in folders if all(os.path.isfile(os.path.join(f, n + ".pt")) for n in MOMENT_FILES)]
    planned = [plan_param(f, group, block_size, min_size) for f in fp32]
    q8 = [os.path.join(f, CONVERTED) for f in folders if os.path.isfile(os.path.join(f, CONVERTED))]
    metas = [converted_meta(p) for p in q8]
    fp32_bytes = sum(os.path.getsize(os.path.join(f, n + ".pt")) for f in fp32 for n in MOMENT_FILES)
    would = sum(format.planned_bytes(pl.skeleton, pl.stored, pl.meta) for pl in planned)
    params = sum(_param_numel(f) for f in folders)
    return {"kind": "zero_universal", "path": path, "parameters": len(folders), "params": params,
            "moment_bytes": sum(pl.moment_bytes for pl in planned) + sum(m[INFO_KEY]["moment_bytes"] for m in metas),
            "fp32_bytes": fp32_bytes, "q8_bytes": sum(os.path.getsize(p) for p in q8),
            "convert_would_write": would if fp32 else None, "convert_would_save": fp32_bytes - would if fp32 else None,
            "warnings": [w for pl in planned for w in pl.warnings]}
