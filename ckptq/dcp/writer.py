"""Writing a DCP folder for ``convert`` and ``expand``: all or nothing, with tensors produced when the writer
reaches them, the source's companion files beside them, a marker that says ckptq wrote the folder (an
existing folder is replaced only if it carries one), and the ranks of a torchrun sharing the work."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from .compact import CompactSavePlanner
from torch.distributed.checkpoint.api import CheckpointException

from .. import __version__
from ..codec import signpost
from ..errors import InputError, OutputExistsError
from ..format import files
from . import safe_reader

MARKER = ".ckptq"  # in every folder ckptq writes: {"created_by": ..., "kind": "dcp"}


class LazyWriter(CompactSavePlanner):
    """Writes tensors that are produced when the writer reaches them (``producers[key](buffer)``), each
    through a buffer reused for every tensor of its dtype and shape: DCP's writer keeps a reference to every
    tensor it wrote to a file until the file is closed, so fresh tensors would pile up to the size of the
    output; reused buffers bound memory by the distinct shapes instead. A producer may fill the buffer it is
    given (exact tensors are read straight into it) or return another tensor, which is copied in."""

    def __init__(self, producers: dict):
        super().__init__()
        self.producers = producers
        self.buffers: dict = {}

    def resolve_data(self, write_item):
        produce = self.producers.get(write_item.index.fqn)
        if produce is None:
            return super().resolve_data(write_item)
        meta = write_item.tensor_data
        key = (meta.properties.dtype, tuple(meta.size))
        buf = self.buffers.get(key)
        if buf is None:
            buf = self.buffers[key] = torch.empty(key[1], dtype=key[0])
        t = produce(buf)
        return buf if t is buf else buf.copy_(t)


def _copy_companions(src: str, dst: str) -> None:
    """Files beside the DCP data that the framework reads too (Lightning's ``meta.pt``), copied as they are."""
    for name, kind in safe_reader.companions(src):
        if name == MARKER:
            continue
        source, target = os.path.join(src, name), os.path.join(dst, name)
        if kind == "folder":
            os.mkdir(target)
            shutil.copymode(source, target)
        elif kind == "link":
            os.symlink(os.readlink(source), target)
        else:
            with files.open_regular(source, "companion file") as f, open(target, "wb") as out:
                shutil.copyfileobj(f, out)
            shutil.copystat(source, target)


def written_by_ckptq(path: str) -> bool:
    """Whether the folder ``path`` carries ckptq's marker (a folder ``convert`` or ``expand`` wrote)."""
    return os.path.isfile(os.path.join(path, MARKER)) and not os.path.islink(path)


def _check_replaceable(dst: str, force: bool) -> None:
    if not os.path.lexists(dst) or (not os.path.islink(dst) and signpost.is_signpost_folder(dst)):
        return  # nothing there, or ckptq's signpost standing in for the folder written now
    if not force:
        raise OutputExistsError(f"{dst} exists; pass --force to overwrite it")
    if not (os.path.isdir(dst) and written_by_ckptq(dst)):
        raise OutputExistsError(f"{dst} exists and is not a folder ckptq wrote (no {MARKER} in it); --force replaces "
                                "only ckptq's own outputs, so nothing was written: choose another output path")


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def write_folder(dst: str, state: dict, producers: dict, force: bool, src: str | None = None) -> None:
    """``dcp.save`` of ``state`` (meta tensors produced lazily) into ``dst``, all or nothing: a temp folder
    beside it, renamed into place (by rank 0 under torchrun, after every rank wrote). The other files of
    ``src`` (e.g. Lightning's ``meta.pt``) come along."""
    from torch.distributed.checkpoint import FileSystemWriter

    _check_replaceable(dst, force)
    tmp = f"{dst.rstrip('/')}.ckptq-tmp"
    if _rank0():
        if os.path.lexists(tmp) and not written_by_ckptq(tmp):
            raise OutputExistsError(f"{tmp} exists (a temp folder of another run?); remove it to write {dst}")
        files.remove_path(tmp)
        os.makedirs(tmp)
        try:
            _copy_companions(src, tmp) if src else None
            with open(os.path.join(tmp, MARKER), "w") as f:
                json.dump({"created_by": f"ckptq {__version__}", "kind": "dcp"}, f)
        except BaseException:
            files.remove_path(tmp)
            raise
    if dist.is_initialized():
        dist.barrier()
    writer = FileSystemWriter(tmp, single_file_per_rank=True, thread_count=1, sync_files=True)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state, storage_writer=writer, planner=LazyWriter(producers), no_dist=not dist.is_initialized())
    except BaseException as e:
        if _rank0():
            files.remove_path(tmp)
        if isinstance(e, CheckpointException):  # DCP wraps what a rank raised: say it in one line
            last = [line for line in str(e).splitlines() if line.strip()][-1:] or ["unknown error"]
            raise InputError(f"writing {dst} failed: {last[0].strip()[:300]}") from None
        raise
    if dist.is_initialized():
        dist.barrier()
    if _rank0():
        files.remove_path(dst)  # a folder ckptq wrote (_check_replaceable)
        os.replace(tmp, dst)


def join_torchrun() -> None:
    """Under torchrun (WORLD_SIZE > 1) join its process group, so that ranks share the work."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")


def leave_torchrun() -> None:
    """After a successful write, leave the group together: a rank that tears gloo down while another
    still talks to it aborts with SIGABRT. (After an error the CLI leaves it: ``ckptq.cli``.)"""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def mine(keys: list) -> list:
    """This rank's share of the keys under torchrun (all of them in one process)."""
    if not dist.is_initialized():
        return keys
    return keys[dist.get_rank()::dist.get_world_size()]


def gathered(value) -> list:
    """``value`` of every rank (one process: ``[value]``)."""
    if not dist.is_initialized():
        return [value]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
