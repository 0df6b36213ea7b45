"""What a path is, decided in one place, in one order: the source that ``convert``, ``expand`` and ``info``
then call (``ckptq.sources.base.Source``)."""

from __future__ import annotations

import os

from .. import format
from ..errors import InputError
from . import folders
from .base import Source
from .distributed import DcpFolder, DeepSpeedCheckpoint
from .framework import FrameworkFolder, RunFolder, checkpoint_folders
from .single import ConvertedFile, ForeignSafetensors, TorchFile


def _is_ckptq_safetensors(path: str) -> bool:
    return format.files.kind_of(path) == "ckptq"


def detect(path: str, *, run: bool = False) -> Source:
    """The source at ``path``; ``run``: a folder of checkpoint folders, taken as a whole (``convert --all``).
    InputError for what is nothing ckptq reads."""
    from ..deepspeed import zero

    if not os.path.lexists(path):
        raise InputError(f"{path}: no such file or folder")
    if run:
        if not (os.path.isdir(path) and checkpoint_folders(path)):
            raise InputError(f"{path} holds no checkpoint folders (checkpoint-N/, global_stepN/, step-N/) to convert "
                             "with --all; pass a checkpoint folder or file")
        return RunFolder(path, detect, explicit=True)
    if zero.is_zero_checkpoint(path):
        return DeepSpeedCheckpoint(path)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, ".metadata")):
            return DcpFolder(path)
        if not folders.is_checkpoint_folder(path):  # a folder holding one ckptq shard set
            return ConvertedFile(path)
        if not folders.holds_optimizer_files(path) and len(checkpoint_folders(path)) > 1:
            return RunFolder(path, detect, explicit=False)
        return FrameworkFolder(path, detect)
    return _file(path)


def _file(path: str) -> Source:
    from ..codec import checkpoint

    if checkpoint.is_torch_file(path):
        return TorchFile(path)
    if path.endswith(".json") or _is_ckptq_safetensors(path):
        return ConvertedFile(path)
    if format.is_safetensors(path):
        return ForeignSafetensors(path)
    return TorchFile(path)  # its loader says in one line what is wrong with it
