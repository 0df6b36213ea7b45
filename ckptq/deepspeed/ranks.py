"""DeepSpeed ZeRO checkpoints (stages 1, 2 and 3) as DeepSpeed saves them: a save dir (``latest`` +
``global_stepN/``), one ``global_stepN/`` folder, or one rank's optimizer file.

DeepSpeed saves each data-parallel rank's share of the optimizer in its own file,
``[bf16_]zero_pp_rank_R_mp_rank_MM_optim_states.pt``: the rank's flat fp32 partition of the master weights
(``single_partition_of_fp32_groups``, or ``fp32_flat_groups`` in stage 3) and a torch optimizer state dict
(``base_optimizer_state``, or the inner ``optimizer_state_dict`` in stage 3) whose ``exp_avg`` /
``exp_avg_sq`` are flat 1-D partitions of the same length. DeepSpeed resumes only from these files as
they are, at the world size that wrote them, so convert keeps each one's layout and turns it into
``<same name>.q8.safetensors`` (``.q4`` at 4 bits) beside it: the moments low-bit (the codec and rules of a
single-file convert), everything else exact, DeepSpeed's own objects as data (``ckptq.deepspeed.objects``). Blocks run along the flat partition, so a block may straddle two parameters'
slices; the ratio encoding of the first moment keeps each element's update error at 8-bit level anyway.
``expand`` writes the ``.pt`` files back: fp32 master weights bit for bit, the moments decoded, and
DeepSpeed's ``engine.load_checkpoint`` resumes from them. Model states files are never touched. This module
finds and reads the files; ``ckptq.deepspeed.source`` converts, expands and describes them.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..errors import InputError
from ..format import files
from . import objects as zero_pickle

INFO_KEY = "deepspeed_zero"  # the ckptq.info entry that marks a file converted from a DeepSpeed checkpoint
SUFFIXES = {8: ".q8.safetensors", 4: ".q4.safetensors"}  # a converted file beside its .pt, by budget
_RANK_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states(\.pt|\.q[48]\.safetensors)$")


@dataclass
class Partition:
    """One rank's optimizer file, in fp32 (``.pt``), low-bit (``.q8.safetensors`` / ``.q4``) or both."""

    folder: str
    stem: str  # e.g. zero_pp_rank_1_mp_rank_00_optim_states
    rank: int
    mp_rank: int

    @property
    def pt(self) -> str:
        return os.path.join(self.folder, self.stem + ".pt")

    def converted(self, bits: int) -> str:
        return os.path.join(self.folder, self.stem + SUFFIXES[bits])

    @property
    def q8(self) -> str | None:
        """Its converted file (8 or 4 bits), or None."""
        return next((p for p in map(self.converted, SUFFIXES) if os.path.isfile(p)), None)


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
    for name in sorted(os.listdir(folder)):
        m = _RANK_FILE.match(name)
        if m:
            part = _partition(folder, name, m)
            other = found.setdefault((part.mp_rank, part.rank), part)
            if other.stem != part.stem:
                raise InputError(f"{folder} holds two optimizer files of rank {part.rank} (mp rank {part.mp_rank:02d}): "
                                 f"{other.stem} and {part.stem}; the folder mixes checkpoints (move one out)")
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


def _partition(folder: str, name: str, m: re.Match) -> Partition:
    """A rank file's partition; InputError unless its name is one DeepSpeed writes (ranks as it formats
    them: ``zero_pp_rank_1``, never ``_01``) and it is a regular file (a link to a device is not)."""
    rank, mp = int(m[2]), int(m[3])
    if m[2] != str(rank) or m[3] != f"{mp:02d}":
        raise InputError(f"{os.path.join(folder, name)}: DeepSpeed names rank {rank} of mp rank {mp} "
                         f"zero_pp_rank_{rank}_mp_rank_{mp:02d}; a file named otherwise is not one of its rank files "
                         "(move it out of the folder)")
    if not files.is_regular(os.path.join(folder, name)):
        raise InputError(f"{os.path.join(folder, name)} is not a regular file; a rank file must be one "
                         "(move it out of the folder)")
    return Partition(folder, name[: -len(m[4])], rank, mp)


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


def describe(part: Partition, obj: dict) -> dict:
    """What a converted file records of its rank file (``INFO_KEY``)."""
    osd = obj["optimizer_state_dict"]
    return {"rank": part.rank, "mp_rank": part.mp_rank, "world_size": world_size_of(osd),
            "stage": zero_pickle.stage_of(osd.get("zero_stage"))}


def fp32_parts(src: str) -> tuple[list[Partition], list[dict]]:
    """The rank files of ``src`` that have their fp32 ``.pt``, loaded; a folder's world size checked."""
    every = partitions(src)
    parts = [p for p in every if os.path.isfile(p.pt)]
    if not parts:
        raise InputError(f"{src}: no fp32 ZeRO optimizer files (*_optim_states.pt) to convert; "
                         "its partitions are low-bit already (`ckptq expand` restores the .pt files)")
    objs = [load_partition(p.pt) for p in parts]
    if os.path.isdir(src):
        check_world(every, {p.pt: world_size_of(o["optimizer_state_dict"]) for p, o in zip(parts, objs)})
    return parts, objs


def param_count(folder: str, mp_rank: int) -> int | None:
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
