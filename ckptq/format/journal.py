"""The journal of what this process leaves beside the files it works on while it works: its temp files and
folders, and the originals it moves aside to delete them (``--replace``). It lets a later run prove that a
leftover is ckptq's own (``ckptq.format.atomic`` says how it is used). Imports nothing of the format."""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import socket
import stat

TMP_MARK = ".ckptq-tmp-"
ASIDE_MARK = ".ckptq-removing-"  # an original renamed (or linked) aside on its way out: ``atomic.aside_name``


def journal_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ckptq", "temps")


class _Journal:
    """This process's record of what it leaves beside its outputs (one JSON line each: path, device, inode,
    and whether it is a folder), kept only while one of them may still exist."""

    def __init__(self):
        self.path: str | None = None
        self.pid = os.getpid()
        self.entries: list[dict] = []

    def add(self, path: str, dev_ino: tuple | None = None, folder: bool | None = None) -> dict:
        """Record ``path`` (as it is now, or, given ``dev_ino``, the file or folder about to take that name:
        an original about to be moved aside), before anything could leave it behind."""
        if dev_ino is None or folder is None:
            st = os.lstat(path)
            dev_ino, folder = (st.st_dev, st.st_ino), stat.S_ISDIR(st.st_mode)
        if os.getpid() != self.pid:  # a forked child keeps a journal of its own
            self.path, self.pid, self.entries = None, os.getpid(), []
        entry = {"path": os.path.abspath(path), "dev": dev_ino[0], "ino": dev_ino[1]} | ({"folder": True} if folder else {})
        self.entries.append(entry)  # what this run removes on failure
        try:
            if self.path is None:
                os.makedirs(journal_dir(), mode=0o700, exist_ok=True)
                self.path = os.path.join(journal_dir(), f"{socket.gethostname()}-{self.pid}-{secrets.token_hex(6)}.jsonl")
            with open(self.path, "a") as f:
                f.write(json.dumps(entry) + "\n")
        except OSError:  # no writable cache: the temp is still removed by this run, just not by later ones
            pass
        return entry

    def recorded(self, path: str) -> dict | None:
        """The newest entry of this process for ``path``."""
        path = os.path.abspath(path)
        return next((e for e in reversed(self.entries) if e["path"] == path), None)

    def forget(self, paths: list[str]) -> None:
        """Temps of a finished write (renamed into place or removed), asides deleted: no longer this journal's."""
        gone = {os.path.abspath(p) for p in paths}
        self._keep([e for e in self.entries if e["path"] not in gone])

    def drop(self, entry: dict) -> None:
        """One entry (``add``'s), where its path has another entry that stays (a temp's name holding an aside)."""
        self._keep([e for e in self.entries if e is not entry])

    def _keep(self, entries: list[dict]) -> None:
        self.entries = entries
        if self.path is None or os.getpid() != self.pid:
            return
        try:
            if self.entries:
                with open(self.path + ".new", "w") as f:
                    for e in self.entries:
                        f.write(json.dumps(e) + "\n")
                os.replace(self.path + ".new", self.path)
            else:
                os.unlink(self.path)
                self.path = None
        except OSError:
            pass


JOURNAL = _Journal()
atexit.register(lambda: JOURNAL.forget([]))


def _dead(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError, ValueError):  # alive but another user's (EPERM), or not a pid
        return False
    return False


def remove_stale_temps() -> list[str]:
    """Remove what this host's finished ckptq processes recorded and left (the same files and folders, by
    device and inode): temps, and originals moved aside by a ``--replace`` that was killed before it
    deleted them; returns their paths."""
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
                if ours(e):
                    if e.get("folder") is True:
                        shutil.rmtree(e["path"])
                    else:
                        os.unlink(e["path"])
                    removed.append(e["path"])
            os.unlink(journal)
        except (OSError, ValueError, TypeError, KeyError, AttributeError):  # a damaged journal: leave it and what it names
            continue
    return removed


def ours(entry: dict) -> bool:
    """Whether ``entry``'s path still holds what ckptq recorded: the same file or folder (device and inode, a
    regular file or a folder as recorded, this user's), under a name that ckptq makes."""
    try:
        st = os.lstat(entry["path"])
        same = (st.st_dev, st.st_ino) == (entry["dev"], entry["ino"])
    except (OSError, TypeError, ValueError, KeyError):
        return False
    kind = stat.S_ISDIR(st.st_mode) if entry.get("folder") is True else stat.S_ISREG(st.st_mode)
    name = os.path.basename(entry["path"])
    return kind and same and st.st_uid == os.geteuid() and (TMP_MARK in name or ASIDE_MARK in name)


def record_temp(path: str) -> None:
    """Record a file created beside a temp (the header relocation's ``<temp>.r``), created exclusively."""
    JOURNAL.add(path)
