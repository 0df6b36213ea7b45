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

import os
import socket
import tempfile
from contextlib import contextmanager
from typing import Iterator

from ..errors import InputError, OutputExistsError
from . import journal
from .identify import kind_of
from .journal import TMP_MARK, remove_stale_temps  # noqa: F401  (the names tests and callers use)
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
            os.replace(tmp, p)
            WRITTEN.append(p)
    except BaseException:
        for tmp in tmps:
            for leftover in (tmp, tmp + ".r"):
                if os.path.lexists(leftover) and journal.ours({"path": leftover, **_recorded(leftover)}):
                    os.unlink(leftover)
        raise
    finally:
        journal.JOURNAL.forget(tmps + [t + ".r" for t in tmps])


def _recorded(path: str) -> dict:
    dev_ino = journal.JOURNAL.entries.get(os.path.abspath(path))
    return {"dev": dev_ino[0], "ino": dev_ino[1]} if dev_ino else {"dev": None, "ino": None}
