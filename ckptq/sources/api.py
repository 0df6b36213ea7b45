"""ckptq's verbs as Python functions: each checks its options once, finds what the input is (``detect``,
the one place that decides it) and asks that source, which returns a typed report
(``ckptq.sources.reports``)."""

from __future__ import annotations


import os

from .. import _deprecated, format
from ..format import journal
from ..format.identify import kind_of
from ..codec import checkpoint, policy, signpost
from ..errors import InputError, NothingToConvertError, UsageError
from . import folders
from .base import Source
from .framework import FrameworkFolder, RunFolder, checkpoint_folders
from .options import DEFAULT_MAX_SHARD_SIZE, ConvertOptions, ExpandOptions, InfoOptions, Progress
from .reports import ConvertReport, ExpandReport, InfoReport
from .single import ConvertedFile, ForeignSafetensors, TorchFile, load, save  # noqa: F401  (ckptq.load, ckptq.save)


COMPRESS_LEVEL = 3  # zstd's level for compress=True (``ckptq convert --compress``: ``--level``'s default)


@_deprecated.renamed_keywords(dst="output", all="all_checkpoints", compress_level="compress")
def convert(src: str, output: str | None = None, *, bits: int | None = None, replace: bool = False,
            force: bool = False, compress: bool | int = False, all_checkpoints: bool = False, keep_last: int = 0,
            max_shard_size: int | None = DEFAULT_MAX_SHARD_SIZE, trust: bool = False,
            block_size: int | None = None, min_size: int = policy.DEFAULT_MIN_SIZE, key: str | None = None,
            device: str = "auto", backend: str = "auto", compress_threads: int = 0,
            progress: Progress | None = None) -> ConvertReport:
    """Store the fp32 Adam moments in ``src`` at ``bits`` bits per value: a torch.save file or a converted file
    (re-encoded 8 <-> 4) -> safetensors; a Trainer / accelerate / Lightning checkpoint folder: its optimizer
    files, each beside its original; a DCP folder -> a DCP folder; a DeepSpeed ZeRO checkpoint: its rank files
    beside them. Returns a ``ConvertReport``; ``ckptq convert`` maps its options onto these keywords.

    - ``output``: where to write (default: beside ``src``, named ``.q8.safetensors`` or ``.q4``).
    - ``bits``: 8, or 4 (a 6-bit ratio over a 2-bit second moment); None: 8, or 4 where the input's state is
      4-bit (torchao's AdamW4bit): never wider than the input's.
    - ``replace``: delete ``src`` once the output was written, synced, read back and checked, and only if it
      is still the file that was converted; without it the input is kept. Outputs appear only complete and the
      input is never modified. ``force``: overwrite an existing output (only one that convert could have written).
    - ``compress``: a lossless zstd stage on top, ``True`` (level 3) or a level 1..22; ``compress_threads``
      (0: all cores).
    - ``all_checkpoints``: ``src`` is a run's output folder: convert each checkpoint folder in it
      (``checkpoint-N/``, ``step-N/``...) but the newest ``keep_last``.
    - ``max_shard_size``: bytes per output file before it is split into shards and an index (None: never).
    - ``trust``: allow full unpickling of ``src`` (only for files you trust).
    - Rarely needed: ``block_size`` values per scale (default 256 for 8 bits, 128 for 4); states of fewer than
      ``min_size`` elements stay fp32; ``key``: the '/'-separated path of the optimizer state dict (default:
      found by shape); ``device`` (``"auto"``, ``"cpu"``, ``"cuda"``) and ``backend`` (``"auto"``, ``"torch"``,
      ``"triton"``) for the quantization; ``progress(bytes_done, bytes_total)``.

    Renamed keywords, accepted for a release with a DeprecationWarning: ``dst`` (``output``), ``all``
    (``all_checkpoints``), ``compress_level`` (``compress``)."""
    opts = ConvertOptions(output, bits, block_size, min_size, key, device, backend, _compress_level(compress),
                          compress_threads, max_shard_size, force, trust, replace, keep_last, progress).checked()
    journal.remove_stale_temps()  # what a killed run left beside its inputs and outputs, before this one looks
    return detect(src, run=all_checkpoints).convert(opts)


def _compress_level(compress: bool | int | None) -> int | None:
    """``convert``'s ``compress`` as a zstd level (None: no zstd stage); a bad level is refused by ``checked``."""
    if compress is None or compress is False:
        return None
    if compress is True:
        return COMPRESS_LEVEL
    if not isinstance(compress, int):
        raise UsageError(f"compress={compress!r:.40}: pass True, False or a zstd level from 1 to 22")
    return compress


@_deprecated.renamed_keywords(dst="output")
def expand(src: str, output: str | None = None, *, replace: bool = False, force: bool = False, verify: bool = True,
           trust: bool = False, progress: Progress | None = None) -> ExpandReport:
    """A converted file (or shard set) -> an ordinary torch.save checkpoint with fp32 (original dtype) states;
    a torch.save file holding 8-bit state (ckptq's, bitsandbytes', torchao's) likewise; a Trainer /
    accelerate / Lightning checkpoint folder: its converted files -> the files the framework's resume reads;
    a DCP folder or a DeepSpeed checkpoint: back to what they were. ``output``: where to write (default:
    beside ``src``, ``.fp32.pt``, or the framework's own file names). ``replace``: the source is deleted once
    the output was written, synced, read back and checked; ``force``: overwrite an existing torch.save output;
    ``verify``: check every stored tensor's checksum; ``trust``: allow full unpickling of a ``.pt`` input
    (torchao's state needs it). Returns an ``ExpandReport``. ``dst`` (renamed ``output``) is accepted for a
    release with a DeprecationWarning."""
    opts = ExpandOptions(output, force, verify, trust, replace, progress).checked()
    journal.remove_stale_temps()
    return detect(src).expand(opts)


def info(path: str, *, bits: int = 8, block_size: int | None = None, min_size: int = policy.DEFAULT_MIN_SIZE,
         key: str | None = None, trust: bool = False) -> InfoReport:
    """What ``path`` holds (states by role and code width, exact tensors, sizes, the options a converted
    file records) and, for fp32 state, what ``convert`` with these options would write."""
    return detect(path).info(InfoOptions(bits, block_size, min_size, key, trust).checked())


def _is_ckptq_safetensors(path: str) -> bool:
    return kind_of(path) == "ckptq"


def detect(path: str, *, run: bool = False) -> Source:
    """The source at ``path``; ``run``: a folder of checkpoint folders, taken as a whole (``convert --all``,
    ``convert(all_checkpoints=True)``).
    InputError for what is nothing ckptq reads."""
    from ..deepspeed.source import DeepSpeedCheckpoint, is_zero_checkpoint

    if not os.path.lexists(path):
        raise InputError(f"{path}: no such file or folder")
    if run:
        if not (os.path.isdir(path) and checkpoint_folders(path)):
            raise InputError(f"{path} holds no checkpoint folders (checkpoint-N/, global_stepN/, step-N/, stepN/) nor "
                             "several Lightning .ckpt files to convert with --all; pass a checkpoint folder or file")
        return RunFolder(path, detect, explicit=True)
    if is_zero_checkpoint(path):
        return DeepSpeedCheckpoint(path)
    if os.path.isdir(path):
        message = signpost.folder_message(path)
        if message is not None:  # never unpickled: its .metadata is what stops a stock loader
            raise NothingToConvertError(f"{path} is a signpost ckptq left in place of a DCP folder: {message}",
                                        reason="a signpost (converted already)")
        if os.path.isfile(os.path.join(path, ".metadata")):
            from ..dcp.source import DcpFolder  # imports torch.distributed.checkpoint: only for a DCP folder

            return DcpFolder(path)
        if not folders.is_checkpoint_folder(path):  # a folder holding one ckptq shard set
            return ConvertedFile(path)
        members = checkpoint_folders(path)  # a run's folder, with one checkpoint so far or many
        if members and (not folders.holds_optimizer_files(path) or members[0].endswith(".ckpt")):
            return RunFolder(path, detect, explicit=False)
        return FrameworkFolder(path, detect)
    return _file(path)


def _file(path: str) -> Source:
    if checkpoint.is_torch_file(path):
        return TorchFile(path)
    if _is_ckptq_safetensors(path):
        return ConvertedFile(path)
    if format.is_safetensors(path):  # no ckptq.format in its first 64 KiB: a model's weights, say
        return ForeignSafetensors(path)
    if path.endswith((".json", format.SUFFIX)):
        return ConvertedFile(path)  # a damaged one: its reader says in one line what is wrong with it
    return TorchFile(path)  # its loader says in one line what is wrong with it
