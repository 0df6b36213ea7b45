"""The C CPU kernels (``cpu_kernels.c`` and the SIMD layer it includes, ``simd*.h``): built on first use,
cached, called through ctypes.

``backend_native`` calls them (``ckptq.codec.ops`` sends CPU work there when they are available, to the
PyTorch reference otherwise; both give the same bits, tests/kernels/test_quantize.py and test_step*.py). The
source is compiled
with the system C compiler (``$CC``, else ``cc``) for this machine's CPU into a cache folder
(``$CKPTQ_CACHE_DIR``, else ``$XDG_CACHE_HOME/ckptq`` or ``~/.cache/ckptq``), once per source (the .c and
every header), compiler (and version), flags and CPU (as the compiler resolves -march for it): a few
seconds, under a lock. -march picks the SIMD path (AVX-512, AVX2, aarch64 NEON, else scalar C:
``simd.h``); ``$CKPTQ_NATIVE_MARCH`` caps it.
What is loaded, and from where, is checked first (``native_build``): a cache folder others can write
means a private build for this run only; a damaged build is rebuilt. ``CKPTQ_NATIVE=0`` turns it off.
No compiler or a failed build means PyTorch, with one warning that says why.

ctypes releases the GIL for the length of a call, so the callers run chunks of a tensor on a thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

from . import native_build

SOURCE = Path(__file__).with_name("cpu_kernels.c")
# What SOURCE includes (the SIMD layer: simd.h picks one of the others by -march): part of the build's
# cache key, and shipped beside it (pyproject's package-data; tests/kernels/test_native_loading.py checks the list is
# whole).
HEADERS = tuple(SOURCE.with_name(name) for name in
                ("simd.h", "simd_scalar.h", "simd_avx512.h", "simd_avx2.h", "simd_neon.h", "step.h", "step_rules.h"))
# No FMA contraction (each fp32 operation rounded on its own, as PyTorch's eager ops do); no errno, so
# sqrtf is the IEEE instruction. Nothing that changes results (no -ffast-math).
_FLAGS = ["-O3", "-std=c99", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared"]


def _arch_flags() -> tuple[list[str], list[str]]:
    """-march for this CPU (``$CKPTQ_NATIVE_MARCH`` overrides ``native``: it caps the SIMD path, so that the
    tests build x86-64-v2 (scalar C) and x86-64-v3 (AVX2) variants on a wider CPU), then no -march at all
    where the compiler refuses that."""
    return [f"-march={os.environ.get('CKPTQ_NATIVE_MARCH') or 'native'}"], []


_P, _I64, _INT, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int32
_SIGNATURES = {
    "ckq_quantize": [_P, _INT, _I64, _I64, _I64, _I64, _INT, _P, _P, _P, _INT, _P],
    "ckq_dequantize": [_P, _P, _P, _I64, _I64, _I64, _I64, _INT, _P, _INT, _INT],
    "ckq_step_group": [_P, _P, _P, _P, _P, _P, _P, _I64, _P],
    "ckq_dense_group": [_P, _P, _P, _P, _P, _P, _I64, _P],
    "ckq_rule_id": [ctypes.c_char_p],
}


class SlotConfig(ctypes.Structure):
    """``slot_config_t`` of step.h, field for field: one state slot as a group's members store it (addresses
    of fp32 / int32 tensors; floor_table None where there is none)."""

    _fields_ = [("decode", _P), ("table", _P), ("floor_table", _P), ("thresholds", _P), ("encode", _P),
                ("bits", _I32), ("decode_as", _I32), ("encode_as", _I32), ("divisor", _I32), ("seeded", _I32)]


class StepConfig(ctypes.Structure):
    """``step_config_t`` of step.h, field for field: what a step group's members share."""

    _fields_ = [("slot", SlotConfig * 3), ("rule", _I32), ("flags", _I32), ("slots", _I32), ("block", _I32),
                ("pdtype", _I32), ("gdtype", _I32), ("fields", _I32), ("dec_eps", _I32), ("enc_eps", _I32)]


class DenseConfig(ctypes.Structure):
    """``dense_config_t`` of step.h, field for field."""

    _fields_ = [("rule", _I32), ("flags", _I32), ("slots", _I32), ("pdtype", _I32), ("gdtype", _I32),
                ("fields", _I32)]


_lock = threading.Lock()


def enabled() -> bool:
    return os.environ.get("CKPTQ_NATIVE", "1") != "0"


def cache_dir() -> Path:
    if os.environ.get("CKPTQ_CACHE_DIR"):
        return Path(os.environ["CKPTQ_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ckptq"


def _cpu_signature() -> str:
    """What -march=native depends on: the machine and, on Linux, the CPU's model and flags."""
    parts = [platform.machine()]
    try:
        with open("/proc/cpuinfo") as f:
            parts += sorted({line.strip() for line in f if line.startswith(("model name", "flags", "Features"))})
    except OSError:
        parts.append(platform.processor())
    return "\n".join(parts)


def _compiler() -> list[str] | None:
    """``$CC`` split like a shell would (``ccache gcc`` works), else ``cc``; None if not on PATH."""
    cmd = shlex.split(os.environ.get("CC") or "cc")
    return cmd if cmd and shutil.which(cmd[0]) else None


def _compiler_version(cmd: list[str]) -> str:
    try:
        done = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=60)
        return (done.stdout.splitlines() or [""])[0]
    except (OSError, subprocess.SubprocessError):
        return ""


def _build(cmd: list[str], target: Path) -> str | None:
    """Compile SOURCE and install it at target with its hash record; None on success, else the
    compiler's complaint. The caller holds the folder's build lock, or the folder is its own."""
    errors = []
    for i, arch in enumerate(_arch_flags()):
        fd, tmp = tempfile.mkstemp(prefix=native_build.TEMP_PREFIX + "cpu_kernels-", suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            done = subprocess.run([*cmd, *_FLAGS, *arch, "-o", tmp, str(SOURCE), "-lm"],
                                  capture_output=True, text=True, timeout=300)
            if done.returncode == 0:
                native_build.install(Path(tmp), target)
                if i:
                    warnings.warn(f"ckptq: built the C CPU kernels without {' '.join(_arch_flags()[0])} "
                                  f"({errors[0]}); they run, slower", RuntimeWarning, stacklevel=5)
                return None
            errors.append((done.stderr.strip().splitlines() or ["no error output"])[-1])
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return errors[-1]


def _build_name(cmd: list[str]) -> str:
    """The file name of the build for this source (and its headers), compiler (and version), flags, and CPU: both as
    /proc/cpuinfo describes it and as the compiler resolves -march for it, so no two CPUs that differ in
    a feature the build uses can share an entry (a shared home folder on two machines, say)."""
    arch = _arch_flags()[0]
    parts = (SOURCE.read_text(), *(h.read_text() for h in HEADERS), " ".join(cmd), _compiler_version(cmd),
             " ".join(_FLAGS + arch), _cpu_signature(), native_build.resolved_target(cmd, arch))
    return f"cpu_kernels-{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:16]}.so"


def build_path(cmd: list[str]) -> Path:
    """Where the build for this source, compiler (and version), flags and CPU lives in the cache."""
    return cache_dir() / _build_name(cmd)


_held_fds: list[int] = []  # files loaded through /proc/self/fd/N: N stays taken, so the name is never reused


def _open(target: Path) -> tuple[ctypes.CDLL | None, str]:
    """The library at target, bound, if it passes native_build's checks and has every kernel; else
    (None, why). A failed check never reaches dlopen."""
    fd, why = native_build.open_verified(target)
    if fd is None:
        return None, why
    try:
        lib = ctypes.CDLL(native_build.loadable_path(fd, target))
    except OSError as exc:
        os.close(fd)
        return None, f"{target} does not load: {exc}"
    _held_fds.append(fd)  # dlopen matches by name first: a reused /proc/self/fd/N would return this one
    try:
        return _bind(lib), ""
    except AttributeError as exc:
        return None, f"{target} lacks a kernel ({exc})"


def _load_cached(cmd: list[str], target: Path) -> ctypes.CDLL | None:
    """Load the cached build, or build it once under the folder's lock (processes that wait for the
    lock load what the first one built); a build that fails the checks is rebuilt once."""
    lib, _ = _open(target)
    if lib is not None:
        return lib
    with native_build.build_lock(target.parent):
        lib, _ = _open(target)  # built by another process while this one waited
        if lib is not None:
            return lib
        error = _build(cmd, target)
    if error is not None:
        return _unavailable(f"compiling {SOURCE.name} failed: {error}")
    lib, why = _open(target)
    return lib if lib is not None else _unavailable(f"the fresh build fails its checks: {why}")


def _load_private(cmd: list[str], refused: str) -> ctypes.CDLL | None:
    """Build for this process only, in a fresh private folder (removed again), when the cache folder
    cannot be used safely: a second or so per run instead of loading what others could have planted."""
    try:
        with native_build.private_tempdir() as folder:
            target = folder / _build_name(cmd)
            error = _build(cmd, target)
            lib, why = (None, f"compiling {SOURCE.name} failed: {error}") if error else _open(target)
    except (OSError, subprocess.SubprocessError) as exc:
        lib, why = None, f"{type(exc).__name__}: {exc}"
    if lib is None:
        return _unavailable(f"cache folder refused: {refused}; and a private build failed: {why}")
    warnings.warn(f"ckptq: C kernel cache not used: {refused}; built the kernels for this run only "
                  "(chmod go-w that folder, or set CKPTQ_CACHE_DIR to one only you can write)", RuntimeWarning,
                  stacklevel=4)
    return lib


@functools.lru_cache(maxsize=1)
def _load() -> ctypes.CDLL | None:
    """From the cache folder when it is private, else built privately for this process; else None."""
    if os.name != "posix":
        return _unavailable("the loader's ownership checks and build lock need a POSIX system")
    cmd = _compiler()
    if cmd is None:
        return _unavailable(f"no C compiler ({os.environ.get('CC') or 'cc'!r} not found; set CC)")
    try:
        folder = native_build.private_dir(cache_dir())
        refused = native_build.untrusted(folder)
        if refused is None:
            return _load_cached(cmd, folder / _build_name(cmd))
    except (OSError, subprocess.SubprocessError) as exc:
        refused = f"{type(exc).__name__}: {exc}"
    return _load_private(cmd, refused)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the exported functions' signatures (each returns an int: 0, or -1 for arguments it cannot
    take; ckq_rule_id a rule's id or -1)."""
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return lib


_why: list[str] = []


def why_unavailable() -> str:
    if not enabled():
        return "turned off by CKPTQ_NATIVE=0"
    return _why[-1] if _why else "not built yet"


def _unavailable(why: str) -> None:
    _why.append(why)
    warnings.warn(f"ckptq: C CPU kernels unavailable ({why}); using the slower PyTorch path", RuntimeWarning, stacklevel=3)
    return None


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (disabled by CKPTQ_NATIVE=0, or they could not be built)."""
    if not enabled():
        return None
    with _lock:  # one build even when pool threads ask at once
        return _load()
