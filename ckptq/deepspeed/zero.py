"""DeepSpeed checkpoints: which ones ckptq reads, and where ``convert`` / ``expand`` send them.

ZeRO stage 1, 2 and 3 checkpoints as DeepSpeed saves them (``ckptq.zero_ranks``: a save dir, a
``global_stepN`` folder, one rank's optimizer file) and universal checkpoint folders
(``ckptq.zero_universal``). Both convert beside the originals, where expand writes the files back and
DeepSpeed reads them, so an output path is refused.
"""

from __future__ import annotations

import os

from . import ranks as zero_ranks, universal as zero_universal
from ..errors import UsageError


def is_zero_checkpoint(path: str) -> bool:
    """A DeepSpeed ZeRO checkpoint (save dir, tag folder, rank file) or universal checkpoint folder."""
    return zero_universal.is_universal(path) or zero_ranks.is_rank_checkpoint(path)


def _in_place(src: str, dst: str | None, verb: str) -> None:
    if dst is not None and os.path.realpath(dst) != os.path.realpath(src):
        raise UsageError(f"-o {dst}: a DeepSpeed checkpoint is {verb} beside its partition files, where DeepSpeed "
                         "reads them; leave -o out")


def convert(src: str, dst: str | None = None, *, block_size: int, min_size: int, force: bool = False,
            progress=None) -> dict:
    """Each optimizer file's Adam moments 8-bit, in ``.q8.safetensors`` files beside the originals (all or
    none); the originals stay. Returns the fields of ``pipeline.ConvertReport``."""
    _in_place(src, dst, "converted")
    module = zero_universal if zero_universal.is_universal(src) else zero_ranks
    return module.convert(src, block_size=block_size, min_size=min_size, force=force, progress=progress)


def expand(src: str, dst: str | None = None, *, force: bool = False, verify: bool = True, progress=None) -> dict:
    """The fp32 files DeepSpeed resumes from, written back from the converted ones (all or none). Returns
    the fields of ``pipeline.ExpandReport``."""
    _in_place(src, dst, "expanded")
    module = zero_universal if zero_universal.is_universal(src) else zero_ranks
    return module.expand(src, force=force, verify=verify, progress=progress)
