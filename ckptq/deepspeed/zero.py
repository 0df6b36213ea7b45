"""DeepSpeed checkpoints: which ones ckptq reads, and the verbs on them.

ZeRO stage 1, 2 and 3 checkpoints as DeepSpeed saves them (``ckptq.deepspeed.ranks``: a save dir, a
``global_stepN`` folder, one rank's optimizer file) and universal checkpoint folders
(``ckptq.deepspeed.universal``). Both convert beside the originals, where expand writes the files back and
DeepSpeed reads them (``ckptq.sources.distributed`` refuses an output path).
"""

from __future__ import annotations

from ..sources.options import ConvertOptions, ExpandOptions, InfoOptions
from ..sources.reports import ConvertReport, ExpandReport, InfoReport
from . import info as zero_info, ranks, universal


def is_zero_checkpoint(path: str) -> bool:
    """A DeepSpeed ZeRO checkpoint (save dir, tag folder, rank file) or universal checkpoint folder."""
    return universal.is_universal(path) or ranks.is_rank_checkpoint(path)


def _module(path: str):
    return universal if universal.is_universal(path) else ranks


def _kind(path: str) -> str:
    return "DeepSpeed universal checkpoint" if universal.is_universal(path) else "DeepSpeed ZeRO checkpoint"


def convert(src: str, opts: ConvertOptions) -> ConvertReport:
    """Each optimizer file's Adam moments low-bit, in ``.q8.safetensors`` (or ``.q4``) files beside the
    originals (all or none); the originals stay."""
    if opts.bits != 8:
        from ..errors import UsageError

        raise UsageError(f"{opts.bits}-bit state is not supported for DeepSpeed checkpoints yet; convert them with --bits 8")
    fields = _module(src).convert(src, block_size=opts.block_size, min_size=opts.min_size, force=opts.force,
                                  progress=opts.progress)
    return ConvertReport(kind=_kind(src), bits=opts.bits, **fields)


def expand(src: str, opts: ExpandOptions) -> ExpandReport:
    """The fp32 files DeepSpeed resumes from, written back from the converted ones (all or none)."""
    fields = _module(src).expand(src, force=opts.force, verify=opts.verify, progress=opts.progress)
    return ExpandReport(src, _kind(src), [fields["output"]], fields["output_bytes"], fields["seconds"])


def info(path: str, opts: InfoOptions) -> InfoReport:
    return zero_info.info(path, min_size=opts.min_size, block_size=opts.block_size, bits=opts.bits)
