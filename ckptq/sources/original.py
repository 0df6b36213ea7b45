"""The input of ``--replace`` as it was when the work started, and its removal once the outputs checked out:
only the very file (or folder) that was converted is ever deleted."""

from __future__ import annotations

import os
import stat

from ..errors import InputError
from ..format import atomic, files


def sync_folder(path: str) -> None:
    """Make the folder entries of ``path`` (a rename into place) durable before anything is deleted."""
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _delete(path: str, original: str, outputs: list[str]) -> None:
    """Delete ``path`` (the original, renamed aside); if that fails, put a file back under its own name and
    say exactly what is left (a folder may be part deleted)."""
    try:
        atomic.remove_aside(path) if path != original else files.remove_path(path)
    except OSError as e:
        left = "it was kept"
        if path != original and os.path.lexists(path):
            try:
                os.rename(path, original)
            except OSError:
                left = f"it is at {path}"
            if os.path.isdir(original):
                left += " (a folder: part of it may be deleted)"
        raise InputError(f"{', '.join(outputs)} written and checked, but {original} could not be deleted "
                         f"({e.strerror}); {left}") from None


class SourceChangedError(InputError):
    """The original changed while it was converted; it was kept."""


def refuse_link(path: str) -> None:
    """InputError, before anything is written, for an input of ``--replace`` that is a symbolic link: the link
    would be replaced, not the file it points to, and telling a rewritten target from the converted one
    compares the target with the link."""
    if os.path.islink(path):
        raise InputError(f"{path} is a symbolic link (to {os.readlink(path)}); --replace replaces only a file or folder "
                         "itself, so nothing was written: pass the path it points to, or convert without --replace")


class Original:
    """An input as it was when ``--replace`` started: its device, inode, size and modification time,
    held open so the inode cannot be reused. ``remove`` deletes the input only if it is still that file: what
    it moves aside (or links aside) is checked, and kept if it is not the file that was converted (a trainer
    rewrote ``last.ckpt`` meanwhile, say), so a file that was not checked is never lost. What a run killed
    on the way leaves beside it (an aside, a temp) is journaled, and removed by the next run of ckptq."""

    def __init__(self, path: str):
        refuse_link(path)
        self.path = path
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self.key = self._key(os.fstat(self._fd), path)

    @staticmethod
    def _key(st: os.stat_result, path: str) -> tuple:
        if stat.S_ISDIR(st.st_mode):  # a folder: its identity and its .metadata's (a DCP folder rewritten in place)
            meta = os.path.join(path, ".metadata")
            inner = os.stat(meta) if os.path.exists(meta) else st
            return (st.st_dev, st.st_ino, inner.st_ino, inner.st_size, inner.st_mtime_ns)
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def _check(self, outputs: list[str]):
        def check(moved: str) -> None:
            if self._key(os.lstat(moved), moved) != self.key:
                raise SourceChangedError(
                    f"{self.path} changed while it was converted (another program rewrote it); it was kept: the "
                    f"output ({', '.join(outputs)}) holds the version that was read, check which one you want")
        return check

    def remove(self, outputs: list[str], also: list[str] = (), stand_in: str | None = None) -> list[str]:
        """Delete the input (and ``also``: the shards of a set) once ``outputs`` are checked, their folder
        entries synced first; SourceChangedError, keeping it, if it is not the file that was converted.
        ``stand_in``: a file or folder this run wrote that takes the input's name as the input goes (a
        signpost, or the input converted in place): the name then names one or the other at every instant
        (``atomic.swap_in``), so a framework looking for it never finds it missing. On failure the stand-in
        is removed."""
        mine = os.lstat(stand_in) if stand_in is not None else None
        try:
            for out in outputs:
                sync_folder(out)
            if stand_in is not None:
                atomic.swap_in(stand_in, self.path, self._check(outputs))
            else:
                aside = atomic.renamed_aside(self.path, self._check(outputs))
                _delete(aside, self.path, outputs)
            for extra in also:
                _delete(extra, extra, outputs)
            sync_folder(self.path)
            return [self.path, *also]
        except OSError as e:  # before anything was replaced: nothing was moved
            verb = "deleted" if stand_in is None else "replaced"
            raise InputError(f"{', '.join(outputs)} written and checked, but {self.path} could not be {verb} "
                             f"({e.strerror}); it was kept") from None
        finally:
            os.close(self._fd)
            if mine is not None and _same(stand_in, mine):
                atomic.discard(stand_in)  # this run's own, never put in place: a failure on the way


def _same(path: str, st: os.stat_result) -> bool:
    try:
        now = os.lstat(path)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)
