"""The input of ``--replace`` as it was when the work started, and its removal once the outputs checked out:
only the very file (or folder) that was converted is ever deleted."""

from __future__ import annotations

import os
import secrets
import stat

from ..errors import InputError
from ..format import files


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
        files.remove_path(path)
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


class Original:
    """An input as it was when ``--replace`` started: its device, inode, size and modification time,
    held open so the inode cannot be reused. ``remove`` deletes the input only if it is still that file: it
    renames the path aside (atomic), checks what it moved, and moves it back if it is not the file that was
    converted (a trainer rewrote ``last.ckpt`` meanwhile, say), so a file that was not checked is never lost."""

    def __init__(self, path: str):
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

    def remove(self, outputs: list[str], also: list[str] = (), stand_in: str | None = None) -> list[str]:
        """Delete the input (and ``also``: the shards of a set) once ``outputs`` are checked, their folder
        entries synced first; SourceChangedError, keeping it, if it is not the file that was converted.
        ``stand_in``: a file this run wrote that takes the input's name as the input goes (a signpost, or the
        input converted in place), so that the name is never missing for a framework looking for it."""
        try:
            for out in outputs:
                sync_folder(out)
            aside = f"{self.path.rstrip(os.sep)}.ckptq-removing-{os.getpid()}-{secrets.token_hex(6)}"
            if os.path.lexists(aside):  # a rename would replace it; the name is random, so this is not ours
                raise InputError(f"{aside} exists; it was not removed and {self.path} was kept (remove or rename it)")
            os.rename(self.path, aside)
            if self._key(os.lstat(aside), aside) != self.key:
                os.rename(aside, self.path)
                raise SourceChangedError(
                    f"{self.path} changed while it was converted (another program rewrote it); it was kept: the "
                    f"output ({', '.join(outputs)}) holds the version that was read, check which one you want")
            if stand_in is not None:
                os.replace(stand_in, self.path)
            _delete(aside, self.path, outputs)
            for extra in also:
                _delete(extra, extra, outputs)
            sync_folder(self.path)
            return [self.path, *also]
        except OSError as e:  # before the rename: nothing was moved
            raise InputError(f"{', '.join(outputs)} written and checked, but {self.path} could not be deleted "
                             f"({e.strerror}); it was kept") from None
        finally:
            os.close(self._fd)
