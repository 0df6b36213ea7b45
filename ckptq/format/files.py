"""Opening inputs safely, removing a path, and bounding the nesting of what was loaded.

Inputs: only regular files are read. A FIFO, socket or device named as an input (or as a shard in an
index) would block ``open`` or read forever, so files are opened non-blocking and checked with
``fstat`` before a byte is read. (Outputs: ``ckptq.format.atomic``; what a file is: ``identify``.)
"""

from __future__ import annotations

import os
import shutil
import stat
from typing import BinaryIO

from ..errors import InputError


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


MAX_NESTING = 100  # containers in a checkpoint nest a few levels; each level of a recursive walk takes stack


def _parts(node, inner) -> tuple | None:
    if isinstance(node, dict):  # read as dict reads itself, whatever a subclass instance says
        return (*dict.keys(node), *dict.values(node))
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
