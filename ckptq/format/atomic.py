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

import atexit
import json
import os
import secrets
import socket
import stat
import tempfile
from contextlib import contextmanager
from typing import Iterator

from ..errors import InputError, OutputExistsError
from .identify import kind_of

TMP_MARK = ".ckptq-tmp-"
WRITTEN: list[str] = []  # outputs put in place by this process (``atomic_outputs``, DCP folders), in order


def written_since(mark: int) -> list[str]:
    """The outputs put in place since ``len(WRITTEN)`` was ``mark`` that are still on disk (a read-back that
    failed removed its output again): what an error message must say was written."""
    return [p for p in dict.fromkeys(WRITTEN[mark:]) if os.path.lexists(p)]


def journal_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ckptq", "temps")


class _Journal:
    """This process's record of the temp files it creates (one JSON line each), kept only while one of
    them may still exist."""

    def __init__(self):
        self.path: str | None = None
        self.pid = os.getpid()
        self.entries: dict[str, tuple] = {}

    def add(self, tmp: str) -> None:
        st = os.lstat(tmp)
        if os.getpid() != self.pid:  # a forked child keeps a journal of its own
            self.path, self.pid, self.entries = None, os.getpid(), {}
        self.entries[os.path.abspath(tmp)] = (st.st_dev, st.st_ino)  # what this run removes on failure
        try:
            if self.path is None:
                os.makedirs(journal_dir(), mode=0o700, exist_ok=True)
                self.path = os.path.join(journal_dir(), f"{socket.gethostname()}-{self.pid}-{secrets.token_hex(6)}.jsonl")
            with open(self.path, "a") as f:
                f.write(json.dumps({"path": os.path.abspath(tmp), "dev": st.st_dev, "ino": st.st_ino}) + "\n")
        except OSError:  # no writable cache: the temp is still removed by this run, just not by later ones
            pass

    def forget(self, tmps: list[str]) -> None:
        """The temps of a finished write: renamed into place or removed, so no longer this journal's."""
        for tmp in tmps:
            self.entries.pop(os.path.abspath(tmp), None)
        if self.path is None or os.getpid() != self.pid:
            return
        try:
            if self.entries:
                with open(self.path + ".new", "w") as f:
                    for path, (dev, ino) in self.entries.items():
                        f.write(json.dumps({"path": path, "dev": dev, "ino": ino}) + "\n")
                os.replace(self.path + ".new", self.path)
            else:
                os.unlink(self.path)
                self.path = None
        except OSError:
            pass


_JOURNAL = _Journal()
atexit.register(lambda: _JOURNAL.forget([]))


def _dead(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError, ValueError):  # alive but another user's (EPERM), or not a pid
        return False
    return False


def remove_stale_temps() -> list[str]:
    """Remove the temps that this host's finished ckptq processes recorded and left (the same files,
    by device and inode); returns their paths."""
    removed = []
    try:
        names = os.listdir(journal_dir())
    except OSError:
        return removed
    host = socket.gethostname()
    for name in names:
        parts = name.removesuffix(".jsonl").rsplit("-", 2)
        if not name.endswith(".jsonl") or len(parts) != 3 or parts[0] != host or not _dead(parts[1]):
            continue
        journal = os.path.join(journal_dir(), name)
        try:
            with open(journal) as f:
                entries = [json.loads(line) for line in f if line.strip()]
            for e in entries:
                if _ours(e):
                    os.unlink(e["path"])
                    removed.append(e["path"])
            os.unlink(journal)
        except (OSError, ValueError, TypeError, KeyError):  # a damaged journal: leave it and what it names
            continue
    return removed


def _ours(entry: dict) -> bool:
    try:
        st = os.lstat(entry["path"])
    except (OSError, TypeError, ValueError):
        return False
    return (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and (st.st_dev, st.st_ino) == (entry["dev"], entry["ino"])
            and TMP_MARK in os.path.basename(entry["path"]))


def new_temp(final: str, suffix: str = ".tmp") -> str:
    """A fresh, recorded temp file beside ``final`` (mode 0666 less the umask, as an output gets)."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(final)), suffix=suffix,
                               prefix=f".{os.path.basename(final)}{TMP_MARK}{socket.gethostname()}-{os.getpid()}-")
    os.close(fd)
    _JOURNAL.add(tmp)
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp, 0o666 & ~mask)  # mkstemp makes 0600
    return tmp


def record_temp(path: str) -> None:
    """Record a file created beside a temp (the header relocation's ``<temp>.r``), created exclusively."""
    _JOURNAL.add(path)


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
        remove_stale_temps()
        for p in finals:
            tmps.append(new_temp(p))
        yield tmps
        for tmp, p in zip(tmps, finals):
            os.replace(tmp, p)
            WRITTEN.append(p)
    except BaseException:
        for tmp in tmps:
            for leftover in (tmp, tmp + ".r"):
                if os.path.lexists(leftover) and _ours({"path": leftover, **_recorded(leftover)}):
                    os.unlink(leftover)
        raise
    finally:
        _JOURNAL.forget(tmps + [t + ".r" for t in tmps])


def _recorded(path: str) -> dict:
    dev_ino = _JOURNAL.entries.get(os.path.abspath(path))
    return {"dev": dev_ino[0], "ino": dev_ino[1]} if dev_ino else {"dev": None, "ino": None}
