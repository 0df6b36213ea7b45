"""Writing outputs atomically, and removing only what ckptq itself left behind.

Each output is written to a temp file beside it (``tempfile.mkstemp``: a name no other run and no user
file has, ``.<name>.ckptq-tmp-<host>-<pid>-<random>.tmp``) and renamed into place when complete; on any
failure, Ctrl-C included, this run removes the temps it created and nothing else.

What a killed run (``kill -9``, power loss) left is removed by later runs only where it is provably
ckptq's own: every temp a process creates is recorded, path, device and inode, in that process's journal
(``~/.cache/ckptq/temps/<host>-<pid>-<random>.jsonl``, or under ``$XDG_CACHE_HOME``); a write first
removes the temps recorded by journals of this host whose process is gone, if the same file (same
device and inode, a regular file of this user) is still there. A file that only looks like a temp (its
name, its place) is never touched; those left by a run whose journal could not be written stay until
removed by hand.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import socket
import stat
import sys
import tempfile
from contextlib import contextmanager
from typing import Callable, Iterator

from ..errors import InputError, OutputExistsError
from . import files, journal
from .identify import kind_of
from .journal import ASIDE_MARK, TMP_MARK, remove_stale_temps  # noqa: F401  (the names tests and callers use)
WRITTEN: list[str] = []  # outputs put in place by this process (``atomic_outputs``, DCP folders), in order


def written_since(mark: int) -> list[str]:
    """The outputs put in place since ``len(WRITTEN)`` was ``mark`` that are still on disk (a read-back that
    failed removed its output again): what an error message must say was written."""
    return [p for p in dict.fromkeys(WRITTEN[mark:]) if os.path.lexists(p)]


def new_temp(final: str, suffix: str = ".tmp") -> str:
    """A fresh, recorded temp file beside ``final`` (mode 0666 less the umask, as an output gets)."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(final)), suffix=suffix,
                               prefix=f".{os.path.basename(final)}{TMP_MARK}{socket.gethostname()}-{os.getpid()}-")
    os.close(fd)
    journal.JOURNAL.add(tmp)
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp, 0o666 & ~mask)  # mkstemp makes 0600
    return tmp


def discard(tmp: str) -> None:
    """A temp of this run's (``new_temp``) that is done with: removed if it is still there, and forgotten."""
    files.remove_path(tmp)
    journal.JOURNAL.forget([tmp])


def check_replaceable(path: str, force: bool, kind: str) -> None:
    """OutputExistsError unless nothing is at ``path``, or ``force`` is given and it is a regular file of
    ``kind`` by its structure (``identify.kind_of``: an output ckptq could have written there) or empty:
    ckptq never replaces a folder, a link to one, a special file, or a file of another kind."""
    if not os.path.lexists(path):
        return
    if not force:
        raise OutputExistsError(f"{path} exists; pass --force (Python: force=True) to overwrite it")
    regular = os.path.isfile(path) and not os.path.islink(path)
    found = kind_of(path) if regular else None
    if found != kind and not (regular and os.path.getsize(path) == 0):  # an empty file holds nothing
        what = ("a folder" if os.path.isdir(path) else "a symlink" if os.path.islink(path)
                else "not a regular file" if not regular
                else "a torch.save checkpoint" if found == "torch" else "a ckptq file" if found == "ckptq"
                else "not a checkpoint file ckptq writes")
        want = "ckptq file" if kind == "ckptq" else "torch.save file"
        raise OutputExistsError(f"{path} exists and is {what}; --force replaces only a {want} (what this command "
                                "writes), so nothing was written: choose another output path or remove it yourself")


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
        journal.remove_stale_temps()
        for p in finals:
            tmps.append(new_temp(p))
        yield tmps
        for tmp, p in zip(tmps, finals):
            if journal.JOURNAL.recorded(p) is not None:  # a temp of this run's own (an in-place expand writes into
                st = os.lstat(tmp)  # one): recorded as the file about to take its name, or a kill leaves it for good
                journal.JOURNAL.add(p, (st.st_dev, st.st_ino), False)
            os.replace(tmp, p)
            WRITTEN.append(p)
    except BaseException:
        for tmp in tmps:
            for leftover in (tmp, tmp + ".r"):
                entry = journal.JOURNAL.recorded(leftover)
                if os.path.lexists(leftover) and entry is not None and journal.ours(entry):
                    os.unlink(leftover)
        raise
    finally:
        journal.JOURNAL.forget(tmps + [t + ".r" for t in tmps])


# --- Replacing and removing an existing name (``--replace``, a DCP folder written over ckptq's own) --------------

def aside_name(path: str) -> str:
    """A name beside ``path`` for its old version on its way out: one no other run and no user file has."""
    return f"{path.rstrip(os.sep)}{journal.ASIDE_MARK}{os.getpid()}-{secrets.token_hex(6)}"


def _renameat2(a: str, b: str, flags: int) -> bool:
    """Linux ``renameat2``; False where the C library or the file system lacks it (the caller falls back)."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(None, use_errno=True).renameat2
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC is False:
        return False
    if _LIBC(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), a)


_LIBC = None
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def exchange(a: str, b: str) -> bool:
    """Swap the names ``a`` and ``b`` (files or folders) in one step: each name exists at every instant.
    False where the system cannot (not Linux, or a file system without ``RENAME_EXCHANGE``)."""
    return sys.platform.startswith("linux") and _renameat2(a, b, _RENAME_EXCHANGE)


def swap_in(new: str, dst: str, check: Callable[[str], None]) -> None:
    """Put ``new`` (this run's file or folder, beside ``dst``) in ``dst``'s place and delete what was there,
    ``dst`` naming one or the other at every instant: a file is hard-linked aside, checked, replaced, then
    its aside unlinked; a folder (or a file where links fail) swapped with ``new`` in one step
    (``exchange``), then checked at ``new``'s name and deleted. ``check(path)`` raises (before anything is
    replaced, or swapping back) to keep what is at ``dst``: the file that was converted must still be there.
    The aside is journaled first, so a killed run's is removed by the next run. Where neither links nor
    swaps work, the old version is renamed aside and ``new`` renamed in: the name is missing for that moment."""
    st = os.lstat(dst)
    folder = stat.S_ISDIR(st.st_mode)
    if not folder and _linked_aside(new, dst, st, check):
        journal.JOURNAL.forget([new])  # it has dst's name now
        return
    entry = journal.JOURNAL.add(new, (st.st_dev, st.st_ino), folder)  # new's name will hold dst's old version
    if exchange(new, dst):
        try:
            check(new)
        except BaseException:
            journal.JOURNAL.drop(entry)  # not the file that was converted: never a later run's to delete
            exchange(new, dst)  # put it back as it was
            raise
        remove_aside(new, dst)
        return
    journal.JOURNAL.drop(entry)
    aside = renamed_aside(dst, check)
    os.replace(new, dst)
    journal.JOURNAL.forget([new])
    remove_aside(aside, dst)


def _linked_aside(new: str, dst: str, st: os.stat_result, check: Callable[[str], None]) -> bool:
    """``swap_in`` of a file through a hard link; False where the file system has no hard links."""
    aside = aside_name(dst)
    journal.JOURNAL.add(aside, (st.st_dev, st.st_ino), False)
    try:
        os.link(dst, aside, follow_symlinks=False)
    except OSError as e:
        journal.JOURNAL.forget([aside])
        if e.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV):
            return False
        raise
    try:
        check(aside)
    except BaseException:
        remove_aside(aside)
        raise
    os.replace(new, dst)
    remove_aside(aside, dst)
    return True


def renamed_aside(path: str, check: Callable[[str], None]) -> str:
    """Rename ``path`` aside (journaled first) and ``check`` what moved; if it raises, rename it back."""
    st = os.lstat(path)
    aside = aside_name(path)
    if os.path.lexists(aside):  # a rename would replace it; the name is random, so this is not ours
        raise InputError(f"{aside} exists; it was not removed and {path} was kept (remove or rename it)")
    journal.JOURNAL.add(aside, (st.st_dev, st.st_ino), stat.S_ISDIR(st.st_mode))
    os.rename(path, aside)
    try:
        check(aside)
    except BaseException:
        journal.JOURNAL.forget([aside])  # not the file that was converted: never a later run's to delete
        os.rename(aside, path)
        raise
    return aside


def remove_aside(aside: str, replaced: str | None = None) -> None:
    """Delete an aside (a file, a link to one, or a folder) and forget it; ``replaced``: the name whose old
    version it is, replaced already (InputError saying where the old version is if it cannot go)."""
    try:
        files.remove_path(aside)
    except OSError as e:
        if replaced is None:
            raise
        raise InputError(f"{replaced} was replaced, but its old version could not be deleted ({e.strerror}); it is "
                         f"at {aside}") from None
    journal.JOURNAL.forget([aside])
