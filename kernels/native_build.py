"""Where the C kernels may be built and loaded from, and what is checked before they are loaded.

Loading a shared library runs its code (constructors) in this process, so a library is loaded only
from a folder that nobody but this user (or root) can write, through every folder above it, and
only when its bytes hash to what this user's own build recorded next to it:

- folders ckptq creates are mode 0700 whatever the umask (as the XDG base-directory spec asks);
- the cache folder, and each folder above it, must be owned by this user or root and writable by
  no one else; a folder above may be writable by others only if it is sticky (``/tmp``), since then
  nobody else can rename or delete what is in it;
- the library and its ``.sha256`` record must be regular files (not symlinks), owned by this user or
  root, writable by no one else, and the library's SHA-256 must equal the record. It is hashed through
  the same open file that is then loaded (``/proc/self/fd``), so what is checked is what is loaded;
- a build and its record are moved into place atomically, under an ``flock`` on ``build.lock`` in the
  cache folder, so processes starting at once build once and the others load that build.

This module imports nothing from ckptq: ``native.py`` calls it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

RECORD_SUFFIX = ".sha256"
LOCK_NAME = "build.lock"
TEMP_PREFIX = ".tmp-"  # every temporary file in the cache folder; any left under the lock is stale


def _owners() -> tuple[int, int]:
    return os.geteuid(), 0  # root can replace anything anyway


def private_dir(path: Path) -> Path:
    """path's real path, creating the missing folders as 0700 (chmod after mkdir: the umask can only
    take bits away, and one without owner bits would leave a folder we cannot use)."""
    missing = []
    p = Path(os.path.abspath(path))
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o700)
            os.chmod(p, 0o700)
        except FileExistsError:
            pass  # another process made it first; untrusted() judges it like any other folder
    return Path(os.path.realpath(path))


def _dir_problem(path: Path, st: os.stat_result, sticky_ok: bool) -> str | None:
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a folder"
    if st.st_uid not in _owners():
        return f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}) or root"
    if st.st_mode & 0o022 and not (sticky_ok and st.st_mode & stat.S_ISVTX):
        return f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def untrusted(folder: Path, sticky_ok: bool = False) -> str | None:
    """Why native code must not be loaded from folder, or None when it is private (sticky_ok: folder
    itself may be a sticky shared one, like /tmp, for a fresh private folder made inside it)."""
    real = Path(os.path.realpath(folder))
    for p in [*reversed(real.parents), real]:
        st = os.lstat(p)  # no symlinks in a real path, unless one was swapped in meanwhile: refused
        problem = _dir_problem(p, st, sticky_ok=sticky_ok or p != real)
        if problem is not None:
            return problem
    return None


def _file_problem(path: Path, st: os.stat_result) -> str | None:
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if st.st_uid not in _owners():
        return f"{path} is owned by uid {st.st_uid}, not by this user or root"
    if st.st_mode & 0o022:
        return f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _read_private(path: Path) -> tuple[int, os.stat_result]:
    """An fd on path that is not a symlink (O_NOFOLLOW) and passes _file_problem; OSError if not."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    problem = _file_problem(path, st)
    if problem is not None:
        os.close(fd)
        raise PermissionError(problem)
    return fd, st


def _sha256_fd(fd: int) -> str:
    digest = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    while chunk := os.read(fd, 1 << 20):
        digest.update(chunk)
    return digest.hexdigest()


def open_verified(lib: Path) -> tuple[int | None, str]:
    """(an fd open on lib, "") when lib and its record pass the checks and the hashes agree, else
    (None, why). A truncated or replaced library fails here and is never handed to dlopen."""
    try:
        rec_fd, _ = _read_private(lib.with_name(lib.name + RECORD_SUFFIX))
        try:
            expected = os.read(rec_fd, 256).decode("ascii", "replace").strip()
        finally:
            os.close(rec_fd)
        fd, _ = _read_private(lib)
    except OSError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    if _sha256_fd(fd) != expected:
        os.close(fd)
        return None, f"{lib} does not match its recorded SHA-256 (truncated or replaced)"
    return fd, ""


def loadable_path(fd: int, lib: Path) -> str:
    """What to hand dlopen: the verified open file itself where /proc/self/fd exists (Linux), so the
    file cannot change between the hash and the load; elsewhere its path, in a private folder."""
    proc = f"/proc/self/fd/{fd}"
    return proc if os.path.exists(proc) else str(lib)


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=path.parent)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def install(built: Path, lib: Path) -> None:
    """Move a finished build into place, then record its hash: a crash in between leaves a library
    whose record does not match, which the next run rebuilds."""
    fd = os.open(built, os.O_RDONLY | os.O_CLOEXEC)
    try:
        digest = _sha256_fd(fd)
    finally:
        os.close(fd)
    os.chmod(built, 0o755)  # readable for a root-prepared cache others load; writable by no one else
    os.replace(built, lib)
    _write_atomic(lib.with_name(lib.name + RECORD_SUFFIX), (digest + "\n").encode())


@contextlib.contextmanager
def build_lock(folder: Path) -> Iterator[None]:
    """Hold the folder's build lock (waits while another process builds), then drop temporary files
    that a killed build left behind: whoever holds the lock is the only one building."""
    import fcntl  # POSIX only; native.py does not get here elsewhere

    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        for stale in folder.glob(TEMP_PREFIX + "*"):
            stale.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def private_tempdir() -> Iterator[Path]:
    """A fresh 0700 folder for a build used by this process only, removed afterwards (a loaded
    library stays mapped after its file is gone); OSError if the temp folder's parent is not private."""
    parent = Path(os.path.realpath(tempfile.gettempdir()))
    problem = untrusted(parent, sticky_ok=True)
    if problem is not None:
        raise PermissionError(f"the temporary folder is not safe either: {problem}")
    folder = Path(tempfile.mkdtemp(prefix="ckptq-native-", dir=parent))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def resolved_target(cmd: list[str], arch: list[str]) -> str:
    """What the compiler makes of the -march flags on this machine: the driver's own expansion (``-###``:
    gcc lists every -m feature flag and cache size it chose for -march=native, clang its -target-cpu and
    -target-features), so two CPUs that differ in anything the build uses get different cache entries.
    Paths (temporary file names among them) are left out: they change from run to run."""
    try:
        done = subprocess.run([*cmd, *arch, "-###", "-x", "c", "-c", os.devnull, "-o", os.devnull],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unresolved: {type(exc).__name__}"
    tokens = []
    for line in (done.stderr + done.stdout).splitlines():
        try:
            words = shlex.split(line)
        except ValueError:
            words = line.split()
        tokens += [w for w in words if "/" not in w]
    return f"rc={done.returncode} " + " ".join(tokens)
