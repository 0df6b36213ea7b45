"""Writing a DCP folder for ``convert`` and ``expand``: all or nothing, with tensors produced when the writer
reaches them, the source's companion files beside them, a marker that says ckptq wrote the folder (an
existing folder is replaced only if it carries one), and the ranks of a torchrun sharing the work."""

from __future__ import annotations

import json
import tempfile
import os
import shutil
import stat
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from .compact import CompactSavePlanner
from torch.distributed.checkpoint.api import CheckpointException

from .. import __version__
from ..codec import signpost
from ..errors import InputError, OutputExistsError
from ..format import atomic, files, journal
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


def _listing(folder: str) -> dict:
    """{relative path: size, or "folder" / "link"} of everything under ``folder`` but the marker, links not followed."""
    found, pending = {}, [""]
    while pending:
        rel = pending.pop()
        for entry in os.scandir(os.path.join(folder, rel)):
            name = os.path.join(rel, entry.name)
            if name == MARKER:
                continue
            if entry.is_symlink():
                found[name] = "link"
            elif entry.is_dir(follow_symlinks=False):
                found[name] = "folder"
                pending.append(name)
            else:
                found[name] = entry.stat(follow_symlinks=False).st_size
    return found


def _write_marker(folder: str) -> None:
    """The marker, listing every file ckptq wrote into ``folder`` (what a later --force may remove)."""
    with open(os.path.join(folder, MARKER), "w") as f:
        json.dump({"created_by": f"ckptq {__version__}", "kind": "dcp", "files": _listing(folder)}, f)


def written_by_ckptq(path: str) -> bool:
    """Whether the folder ``path`` holds exactly what ckptq wrote there (``convert`` or ``expand``): its
    marker lists every file, with its size, and nothing was added, removed or resized since. A folder
    written by ckptq before markers listed files counts only if it holds nothing but DCP's own files."""
    if os.path.islink(path) or not os.path.isdir(path):
        return False
    try:
        with files.open_regular(os.path.join(path, MARKER), "marker") as f:
            marker = json.loads(f.read(1 << 20))
        listing = _listing(path)
    except (InputError, OSError, ValueError):
        return False
    if not (isinstance(marker, dict) and marker.get("kind") == "dcp"
            and str(marker.get("created_by", "")).startswith("ckptq ")):
        return False
    if "files" in marker:
        return marker["files"] == listing
    return all(n == ".metadata" or n.endswith(".distcp") for n in listing)


def _check_replaceable(path: str, force: bool, dst: str | None = None) -> None:
    """OutputExistsError unless the output folder ``dst`` may replace what is at ``path`` (``dst`` itself, or
    where its old version was moved to be checked again): nothing, ckptq's signpost exactly as ckptq left it,
    or with ``force`` a folder ckptq wrote, exactly as it wrote it."""
    dst = dst or path
    if not os.path.lexists(path) or (not os.path.islink(path) and signpost.is_signpost_folder(path)):
        return  # nothing there, or ckptq's signpost standing in for the folder written now
    changed = None if os.path.islink(path) else signpost.not_a_signpost(path)
    if changed is not None:  # never ckptq's to replace, with or without --force
        raise OutputExistsError(f"{dst} holds a ckptq signpost marker ({MARKER}) but {changed}: it is not a signpost as "
                                "ckptq writes them (something else wrote into it), so it was kept and nothing was written; "
                                "choose another output path, or move it away yourself")
    if not force:
        raise OutputExistsError(f"{dst} exists; pass --force to overwrite it")
    if not written_by_ckptq(path):
        raise OutputExistsError(f"{dst} exists and is not a folder ckptq wrote, as it wrote it (its {MARKER} must list "
                                "everything in it); --force replaces only ckptq's own outputs, so nothing was written: "
                                "choose another output path or remove it yourself")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def write_folder(dst: str, state: dict, producers: dict, force: bool, src: str | None = None) -> None:
    """``dcp.save`` of ``state`` (meta tensors produced lazily) into ``dst``, all or nothing: a temp folder
    beside it, renamed into place (by rank 0 under torchrun, after every rank wrote). The other files of
    ``src`` (e.g. Lightning's ``meta.pt``) come along."""
    from torch.distributed.checkpoint import FileSystemWriter

    _check_replaceable(dst, force)
    tmp = None
    if _rank0():  # a folder of this run's own: no other run's, and no user's, has its name
        parent, name = os.path.split(os.path.abspath(dst.rstrip("/")))
        tmp = tempfile.mkdtemp(dir=parent, prefix=f".{name}{journal.TMP_MARK}")
        journal.JOURNAL.add(tmp)  # a run killed while writing leaves it to the next run to remove
        os.chmod(tmp, 0o777 & ~_umask())
        try:
            _copy_companions(src, tmp) if src else None
        except BaseException:
            files.remove_path(tmp)
            raise
    if dist.is_initialized():
        shared = [tmp]
        dist.broadcast_object_list(shared, src=0)
        tmp = shared[0]
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
        try:
            _write_marker(tmp)
            if os.path.lexists(dst) and not os.path.islink(dst) and os.path.isdir(dst):
                # swapped in, then what was there checked again where it now lies: a folder ckptq wrote (or
                # its signpost), unchanged since; else swapped back and kept. The name never goes missing.
                atomic.swap_in(tmp, dst, lambda old: _check_replaceable(old, force, dst))
            else:
                _check_replaceable(dst, force)
                os.replace(tmp, dst)
            atomic.WRITTEN.append(dst)
        except BaseException:
            files.remove_path(tmp)
            raise
        finally:
            journal.JOURNAL.forget([tmp])


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
    """The bytes of the regular files directly in ``path`` (links not followed: one may dangle)."""
    sizes = (os.lstat(os.path.join(path, f)) for f in os.listdir(path))
    return sum(st.st_size for st in sizes if stat.S_ISREG(st.st_mode))
