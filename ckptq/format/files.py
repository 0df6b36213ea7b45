"""Opening inputs safely and writing outputs atomically.

Inputs: only regular files are read. A FIFO, socket or device named as an input (or as a shard in an
index) would block ``open`` or read forever, so files are opened non-blocking and checked with
``fstat`` before a byte is read.

Outputs: each is written to a temp file beside it and renamed into place when complete. Temp names are
recognisable, ``.<name>.ckptq-tmp-<host>-<pid>-<random>.tmp`` (``.r`` appended while a header is
relocated), so that what a killed run (``kill -9``, power loss) left behind can be told apart: every
write removes the temp files in its output folder that this host's dead processes left and that belong
to the same user. Anything else is left alone; such files can also be deleted by hand at any time when
no ckptq run is writing to that folder.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import stat
import tempfile
from contextlib import contextmanager
from typing import BinaryIO, Iterator

from ..errors import InputError, OutputExistsError

TMP_MARK = ".ckptq-tmp-"


def remove_path(path: str) -> None:
    """Delete a file, a link (not what it points to) or a folder tree; nothing if it does not exist."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def open_regular(path: str, what: str = "input") -> BinaryIO:
    """Open ``path`` for reading if it is a regular file (symlinks to one are fine); never blocks."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except OSError as e:
        raise InputError(f"cannot open {what} {path}: {e.strerror}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
        raise InputError(f"{what} {path} is {kind}; ckptq reads only regular files")
    if hasattr(os, "set_blocking"):
        os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def is_regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def _tmp_prefix(final: str) -> str:
    return f".{os.path.basename(final)}{TMP_MARK}{socket.gethostname()}-{os.getpid()}-"


def _stale(folder: str, name: str) -> bool:
    """A temp file of ours (same host, same user) whose writing process is gone."""
    m = re.fullmatch(rf"\..+{re.escape(TMP_MARK)}{re.escape(socket.gethostname())}-(\d+)-\w+\.tmp(\.r)?", name)
    if not m:
        return False
    try:
        if os.lstat(os.path.join(folder, name)).st_uid != os.geteuid():
            return False
        os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError):  # alive but not ours (EPERM), or gone already
        return False
    return False


def remove_stale_temps(folder: str) -> list[str]:
    """Delete the temp files that killed ckptq runs of this user on this host left in ``folder``."""
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        if TMP_MARK in name and _stale(folder, name):
            try:
                os.unlink(os.path.join(folder, name))
                removed.append(name)
            except OSError:
                pass
    return removed


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


KINDS = ("ckptq", "torch")  # what an output is: a ckptq file (or shard index), a torch.save file


def kind_of(path: str) -> str | None:
    """What the regular file at ``path`` is, by its first bytes: "ckptq" (a safetensors file or shard index
    that ckptq wrote), "torch" (a torch.save zip or pickle), or None (anything else, or not a regular file)."""
    try:
        with open_regular(path, "output") as f:
            head = f.read(1 << 16)
    except InputError:
        return None
    if head[:4] == b"PK\x03\x04" or head[:2] == b"\x80\x02":
        return "torch"
    return "ckptq" if b'"ckptq.format"' in head else None


def check_replaceable(path: str, force: bool, kind: str) -> None:
    """OutputExistsError unless nothing is at ``path``, or ``force`` is given and it is a regular file of
    ``kind`` (an output ckptq could have written there) or empty: ckptq never replaces a folder, a link to
    one, a special file, or a file of another kind, whatever the flags."""
    if not os.path.lexists(path):
        return
    if not force:
        raise OutputExistsError(f"{path} exists; pass --force (Python: force=True) to overwrite it")
    found = kind_of(path) if os.path.isfile(path) else None
    if found != kind and not (os.path.isfile(path) and os.path.getsize(path) == 0):  # an empty file holds nothing
        what = ("a folder" if os.path.isdir(path) else "not a regular file" if not os.path.isfile(path)
                else "a torch.save checkpoint" if found == "torch" else "a ckptq file" if found == "ckptq"
                else "not a checkpoint file")
        want = "ckptq file" if kind == "ckptq" else "torch.save file"
        raise OutputExistsError(f"{path} exists and is {what}; --force replaces only a {want} (what this command "
                                "writes), so nothing was written: choose another output path or remove it yourself")


def temp_beside(final: str) -> str:
    """A new empty temp file beside ``final``, named as this module's temp files are (removed when its
    process is gone: ``remove_stale_temps``); the caller renames it into place or deletes it."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(final)), prefix=_tmp_prefix(final), suffix=".tmp")
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_umask())
    return tmp


@contextmanager
def atomic_outputs(finals: list[str], force: bool, kind: str) -> Iterator[list[str]]:
    """Temp paths beside each final path; all renamed into place on success, all removed on failure
    (including Ctrl-C). An existing final path is replaced only with ``force`` and only if it is a file of
    ``kind`` ("ckptq" or "torch", ``check_replaceable``)."""
    for p in finals:
        check_replaceable(p, force, kind)
    tmps: list[str] = []
    try:
        for folder in {os.path.dirname(os.path.abspath(p)) for p in finals}:
            if not os.path.isdir(folder):
                raise InputError(f"output folder {folder} does not exist")
            remove_stale_temps(folder)
        for p in finals:
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(p)), prefix=_tmp_prefix(p), suffix=".tmp")
            os.close(fd)
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; outputs get the usual permissions
            tmps.append(tmp)
        yield tmps
        for tmp, p in zip(tmps, finals):
            os.replace(tmp, p)
    except BaseException:
        for tmp in tmps:
            for leftover in (tmp, tmp + ".r"):
                if os.path.exists(leftover):
                    os.unlink(leftover)
        raise



MAX_NESTING = 100  # containers in a checkpoint nest a few levels; each level of a recursive walk takes stack


def _parts(node, inner) -> tuple | None:
    if isinstance(node, dict):
        return (*node.keys(), *node.values())
    if isinstance(node, (list, tuple, set, frozenset)):
        return tuple(node)
    return inner(node) if inner else None


def check_nesting(obj, what: str, limit: int = MAX_NESTING, inner=None) -> None:
    """InputError if containers in ``obj`` nest more than ``limit`` deep or one contains itself: an
    unpickler builds such objects without recursing, but the walks that follow (conversion, saving,
    ``torch.save``) recurse and would end in a RecursionError. ``inner(node)`` gives the parts of other
    objects to walk (None for a leaf). Iterative; each container is walked once, its height remembered."""
    heights: dict[int, int] = {}  # id -> levels of containers from it down, once finished
    on_path: set[int] = set()
    stack = [(obj, 1, False)]  # (node, its level, leaving)
    while stack:
        node, level, leaving = stack.pop()
        parts = _parts(node, inner)
        if parts is None:
            continue
        if leaving:
            on_path.discard(id(node))
            heights[id(node)] = 1 + max((heights.get(id(p), 0) for p in parts), default=0)
        elif id(node) in on_path:
            raise InputError(f"{what} holds a container that contains itself; ckptq refuses it (crafted or damaged)")
        elif level + heights.get(id(node), 1) - 1 > limit:
            raise InputError(f"{what} is nested more than {limit} levels deep; ckptq refuses it (crafted or damaged)")
        elif id(node) not in heights:
            on_path.add(id(node))
            stack.append((node, level, True))
            stack.extend((p, level + 1, False) for p in parts)
