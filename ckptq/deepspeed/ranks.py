"""DeepSpeed ZeRO checkpoints (stages 1, 2 and 3) as DeepSpeed saves them: a save dir (``latest`` +
``global_stepN/``), one ``global_stepN/`` folder, or one rank's optimizer file.

DeepSpeed saves each data-parallel rank's share of the optimizer in its own file,
``[bf16_]zero_pp_rank_R_mp_rank_MM_optim_states.pt``: the rank's flat fp32 partition of the master weights
(``single_partition_of_fp32_groups``, or ``fp32_flat_groups`` in stage 3) and a torch optimizer state dict
(``base_optimizer_state``, or the inner ``optimizer_state_dict`` in stage 3) whose ``exp_avg`` /
``exp_avg_sq`` are flat 1-D partitions of the same length. DeepSpeed resumes only from these files as
they are, at the world size that wrote them, so convert keeps each one's layout and turns it into
``<same name>.q8.safetensors`` beside it: the moments blockwise 8-bit (the codec and rules of a
single-file convert, ``ckptq.plan``), everything else exact, DeepSpeed's own objects as data
(``ckptq.zero_pickle``). Blocks run along the flat partition, so a block may straddle two parameters'
slices; the ratio encoding of the first moment keeps each element's update error at 8-bit level anyway.
``expand`` writes the ``.pt`` files back: fp32 master weights bit for bit, the moments decoded, and
DeepSpeed's ``engine.load_checkpoint`` resumes from them. Model states files are never touched.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass

from ..codec import tree
from ..format import files, torch_stream
from . import objects as zero_pickle
from .plan import INFO_KEY, Q8, Planned, converted_meta, plan_tree, report, write_all
from ..errors import FormatError, InputError

_RANK_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states(\.pt|\.q8\.safetensors)$")


@dataclass
class Partition:
    """One rank's optimizer file, in fp32 (``.pt``), 8-bit (``.q8.safetensors``) or both."""

    folder: str
    stem: str  # e.g. zero_pp_rank_1_mp_rank_00_optim_states
    rank: int
    mp_rank: int

    @property
    def pt(self) -> str:
        return os.path.join(self.folder, self.stem + ".pt")

    @property
    def q8(self) -> str:
        return os.path.join(self.folder, self.stem + Q8)


def is_rank_checkpoint(path: str) -> bool:
    """A ZeRO rank's optimizer file (fp32 or converted), a folder holding such files, or a DeepSpeed save
    dir (a ``latest`` file naming the tag folder)."""
    if os.path.isfile(path):
        return bool(_RANK_FILE.match(os.path.basename(path)))
    if not os.path.isdir(path):
        return False
    return os.path.isfile(os.path.join(path, "latest")) or any(_RANK_FILE.match(n) for n in os.listdir(path))


def tag_folder(path: str) -> str:
    """The ``global_stepN`` folder of ``path``: itself, or the one a save dir's ``latest`` names."""
    latest = os.path.join(path, "latest")
    if any(_RANK_FILE.match(n) for n in os.listdir(path)) or not os.path.isfile(latest):
        return path
    with files.open_regular(latest) as f:
        tag = f.read(4096).decode("utf-8", "replace").strip()
    if tag in ("", ".", "..") or any(c in tag for c in "/\\\0") or os.path.isabs(tag):
        raise InputError(f"{latest} names tag {tag[:80]!r}, which is not a folder name; a tag names a folder "
                         "beside it (e.g. global_step100): pass the global_stepN folder to use")
    folder = os.path.join(path, tag)
    if not os.path.isdir(folder):
        raise InputError(f"{latest} names tag {tag[:80]!r}, but {path} has no such folder; pass the "
                         "global_stepN folder to use")
    return folder


def partitions(path: str) -> list[Partition]:
    """The optimizer partitions of a file or folder, sorted by (mp rank, rank); a folder must hold every
    rank 0..N-1 of each model-parallel rank, in the same number."""
    if os.path.isfile(path):
        m = _RANK_FILE.match(os.path.basename(path))
        return [Partition(os.path.dirname(path), os.path.basename(path)[: -len(m[4])], int(m[2]), int(m[3]))]
    folder = tag_folder(path)
    found = {}
    for name in os.listdir(folder):
        m = _RANK_FILE.match(name)
        if m:
            found[(int(m[3]), int(m[2]))] = Partition(folder, name[: -len(m[4])], int(m[2]), int(m[3]))
    if not found:
        raise InputError(f"{folder} holds no DeepSpeed ZeRO optimizer files (zero_pp_rank_R_mp_rank_00_optim_states.pt)")
    for mp in sorted({mp for mp, _ in found}):
        ranks = sorted(r for m, r in found if m == mp)
        missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
        if missing:
            raise InputError(f"{folder}: the optimizer file of rank {missing[0]} (mp rank {mp:02d}) is missing: "
                             f"found ranks {ranks}; a ZeRO checkpoint needs every rank's partition")
    sizes = {mp: sum(1 for m, _ in found if m == mp) for mp, _ in found}
    if len(set(sizes.values())) > 1:
        raise InputError(f"{folder}: model-parallel ranks have different numbers of ZeRO partitions {sizes}; "
                         "the folder mixes checkpoints")
    return [found[k] for k in sorted(found)]


def world_size_of(osd: dict) -> int | None:
    """The data-parallel world size a ZeRO optimizer state dict was partitioned for."""
    count = osd.get("partition_count")
    if isinstance(count, (list, tuple)) and count and all(c == count[0] for c in count):
        count = count[0]
    return count if isinstance(count, int) else None


def load_partition(path: str) -> dict:
    """A rank's fp32 optimizer file, DeepSpeed's objects as plain dicts; InputError if it is not one."""
    obj = zero_pickle.to_plain(zero_pickle.load(path))
    osd = obj.get("optimizer_state_dict") if isinstance(obj, dict) else None
    if not isinstance(osd, dict) or world_size_of(osd) is None:
        raise InputError(f"{path} is not a DeepSpeed ZeRO optimizer file (no optimizer_state_dict with a "
                         "partition_count)")
    return obj


def check_world(parts: list[Partition], sizes: dict) -> int:
    """The common world size ({path: world size} of the files read) of a folder's partitions (every rank's,
    fp32 or 8-bit); InputError when the sizes disagree with each other or with the ranks present."""
    found = set(sizes.values())
    if len(found) > 1:
        raise InputError(f"{parts[0].folder}: the rank files were written at different world sizes "
                         f"({', '.join(f'{os.path.basename(p)}: {n}' for p, n in sizes.items())}); "
                         "the folder mixes checkpoints")
    world = found.pop()
    ranks = {p.rank for p in parts if p.mp_rank == parts[0].mp_rank}
    missing = sorted(set(range(world)) - ranks)
    if missing:
        raise InputError(f"{parts[0].folder}: the optimizer file of rank {missing[0]} (mp rank {parts[0].mp_rank:02d}) "
                         f"is missing: the checkpoint was written by {world} ranks (partition_count), found "
                         f"{sorted(ranks)}; a ZeRO checkpoint needs every rank's partition")
    if len(ranks) != world:
        raise InputError(f"{parts[0].folder}: {len(ranks)} rank files per model-parallel rank, but they were "
                         f"written by {world} ranks (partition_count); the folder mixes checkpoints")
    return world


def plan_partition(part: Partition, obj: dict, block_size: int, min_size: int) -> Planned:
    osd = obj["optimizer_state_dict"]
    described = {"rank": part.rank, "mp_rank": part.mp_rank, "world_size": world_size_of(osd),
                 "stage": zero_pickle.stage_of(osd.get("zero_stage"))}
    return plan_tree(obj, part.pt, block_size, min_size, described)


def _fp32_parts(src: str) -> tuple[list[Partition], list[dict]]:
    every = partitions(src)
    parts = [p for p in every if os.path.isfile(p.pt)]
    if not parts:
        raise InputError(f"{src}: no fp32 ZeRO optimizer files (*_optim_states.pt) to convert; "
                         "its partitions are 8-bit already (`ckptq expand` restores the .pt files)")
    objs = [load_partition(p.pt) for p in parts]
    if os.path.isdir(src):
        check_world(every, {p.pt: world_size_of(o["optimizer_state_dict"]) for p, o in zip(parts, objs)})
    return parts, objs


def convert(src: str, *, block_size: int, min_size: int, force: bool = False, progress=None) -> dict:
    """Convert every rank's optimizer file of a ZeRO checkpoint to ``<name>.q8.safetensors`` beside it;
    all of them or none. Returns the fields of ``pipeline.ConvertReport``."""
    t0 = time.perf_counter()
    parts, objs = _fp32_parts(src)
    planned = [plan_partition(p, o, block_size, min_size) for p, o in zip(parts, objs)]
    empty = [p.pt for p, pl in zip(parts, planned) if not pl.quantized]
    if empty:
        raise InputError(f"{empty[0]}: no Adam moment to store 8-bit (a flat partition below --min-size "
                         f"{min_size}, or no exp_avg/exp_avg_sq); lower --min-size")
    write_all([p.q8 for p in parts], planned, force, progress)
    return report(src, [p.q8 for p in parts], [p.pt for p in parts], planned, time.perf_counter() - t0)


def expand(src: str, *, force: bool = False, verify: bool = True, progress=None) -> dict:
    """Write each rank's ``.pt`` back from its ``.q8.safetensors`` (all or none), where DeepSpeed reads it.
    Returns the fields of ``pipeline.ExpandReport``."""
    t0 = time.perf_counter()
    every = partitions(src)
    parts = [p for p in every if os.path.isfile(p.q8)]
    if not parts:
        raise InputError(f"{src}: no converted DeepSpeed ZeRO optimizer files (*_optim_states.q8.safetensors) to expand")
    metas = [converted_meta(p.q8) for p in parts]
    if os.path.isdir(src):
        check_world(every, {p.q8: m[INFO_KEY].get("world_size") for p, m in zip(parts, metas)})
    with files.atomic_outputs([p.pt for p in parts], force, "torch") as tmps:
        for p, tmp in zip(parts, tmps):
            conv = tree.Converted(p.q8, verify)
            try:
                obj = zero_pickle.from_plain(conv.read(dequantize=True, lazy=True))
            except FormatError as e:
                raise FormatError(f"{p.q8}: {e}") from None
            torch_stream.save(obj, tmp, progress, pickler=zero_pickle.Pickler)
            conv.close()
    out = parts[0].folder if os.path.isdir(src) else parts[0].pt
    return {"source": src, "output": out, "output_bytes": sum(os.path.getsize(p.pt) for p in parts),
            "seconds": time.perf_counter() - t0}

