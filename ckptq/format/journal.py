"""The journal of the temp files this process creates: what lets a later run prove a leftover temp is
ckptq's own (``ckptq.format.atomic`` says how it is used). Imports nothing of the format."""

from __future__ import annotations

import atexit
import json
import os
import secrets
import socket
import stat

TMP_MARK = ".ckptq-tmp-"


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
                if ours(e):
                    os.unlink(e["path"])
                    removed.append(e["path"])
            os.unlink(journal)
        except (OSError, ValueError, TypeError, KeyError):  # a damaged journal: leave it and what it names
            continue
    return removed


def ours(entry: dict) -> bool:
    try:
        st = os.lstat(entry["path"])
    except (OSError, TypeError, ValueError):
        return False
    return (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and (st.st_dev, st.st_ino) == (entry["dev"], entry["ino"])
            and TMP_MARK in os.path.basename(entry["path"]))


def record_temp(path: str) -> None:
    """Record a file created beside a temp (the header relocation's ``<temp>.r``), created exclusively."""
    JOURNAL.add(path)


