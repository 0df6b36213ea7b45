"""DeepSpeed universal checkpoints (``ds_to_universal.py`` output, what ``"load_universal": true`` resumes
from at any world size): ``zero/<param name>/{fp32,exp_avg,exp_avg_sq,step}.pt``, each moment file a dict
``{"cat_dim": ..., "param": tensor shaped like the parameter}``, plus ``zero/optimizer_state.pt``.

Convert writes one ``zero/<param>/moments.q8.safetensors`` per parameter holding both moments (the first
as a ratio to the second, so they share a file): a one-parameter optimizer state dict, so that
``ckptq.codec.plan`` decides what goes 8-bit with the rules of any convert, with eps and betas from the first
param group of ``optimizer_state.pt`` and the step from ``step.pt``, plus each moment file's other entries.
Expand writes ``exp_avg.pt`` / ``exp_avg_sq.pt`` back. ``fp32.pt`` and ``step.pt`` are never touched.
"""

from __future__ import annotations

import os

import torch

from ..codec import checkpoint
from ..errors import InputError
from ..format import files
from . import objects as zero_pickle
from .ranks import SUFFIXES

MOMENT_FILES = ("exp_avg", "exp_avg_sq")
CONVERTED = {bits: "moments" + suffix for bits, suffix in SUFFIXES.items()}  # beside a parameter's files


def converted(folder: str) -> str | None:
    """A parameter folder's converted moments (8 or 4 bits), or None."""
    return next((p for p in (os.path.join(folder, n) for n in CONVERTED.values()) if os.path.isfile(p)), None)


def is_universal(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "zero", "optimizer_state.pt"))


def param_folders(path: str) -> list[str]:
    root = os.path.join(path, "zero")
    found = sorted(os.path.join(root, n) for n in os.listdir(root) if os.path.isfile(os.path.join(root, n, "fp32.pt")))
    if not found:
        raise InputError(f"{root} holds no parameter folders (<name>/fp32.pt); it is not a universal checkpoint")
    return found


def group(path: str) -> dict:
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


def param_numel(folder: str) -> int:
    obj = _load(os.path.join(folder, "fp32.pt"))
    if not isinstance(obj, dict) or not isinstance(obj.get("param"), torch.Tensor):
        raise InputError(f"{folder}/fp32.pt is not a universal checkpoint parameter file (a dict with 'param')")
    return obj["param"].numel()


def param_state(folder: str, group: dict) -> dict:
    """A parameter's two moment files as a one-parameter optimizer state dict (what the planner decides
    on), with each file's other entries under ``files``."""
    m, v = (_moment_file(folder, n) for n in MOMENT_FILES)
    step_path = os.path.join(folder, "step.pt")
    step = _load(step_path) if os.path.isfile(step_path) else 0
    return {"state": {0: {"step": step, "exp_avg": m["param"], "exp_avg_sq": v["param"]}}, "param_groups": [group],
            "files": {n: {k: (None if k == "param" else x) for k, x in f.items()} for n, f in zip(MOMENT_FILES, (m, v))}}


def fp32_folders(src: str) -> list[str]:
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
