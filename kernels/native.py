"""The C CPU kernels (``cpu_kernels.c``): built on first use, cached, called through ctypes.

``backend_native`` calls them (``ckptq.ops`` sends CPU work there when they are available, to the
PyTorch reference otherwise; both give the same bits, tests/test_native.py). The source is compiled
with the system C compiler (``$CC``, else ``cc``) for this machine's CPU into a cache folder
(``$CKPTQ_CACHE_DIR``, else ``$XDG_CACHE_HOME/ckptq`` or ``~/.cache/ckptq``), once per source, compiler
(and version), flags and CPU: about a second. ``CKPTQ_NATIVE=0`` turns it off. No compiler, a failed build or a read-only cache
means PyTorch, with one warning that says why.

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


SOURCE = Path(__file__).with_name("cpu_kernels.c")
# No FMA contraction (each fp32 operation rounded on its own, as PyTorch's eager ops do); no errno, so
# sqrtf is the IEEE instruction. Nothing that changes results (no -ffast-math).
_FLAGS = ["-O3", "-std=c99", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared"]


def _arch_flags() -> tuple[list[str], list[str]]:
    """-march for this CPU (``$CKPTQ_NATIVE_MARCH`` overrides ``native``: the tests build a portable,
    non-AVX-512 variant with it), then no -march at all where the compiler refuses that."""
    return [f"-march={os.environ.get('CKPTQ_NATIVE_MARCH') or 'native'}"], []


_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "ckq_quantize": [_P, _INT, _I64, _I64, _INT, _P, _P, _P],
    "ckq_dequantize": [_P, _P, _P, _I64, _I64, _INT, _P, _INT],
    "ckq_adam_step": [_P, _INT, _P, _INT, _I64, _I64] + [_P, _P, _P, _P, _INT] + [_P] * 8 + [_P, _INT],
}
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
    """Compile SOURCE into target atomically; None on success, else the compiler's complaint."""
    errors = []
    for i, arch in enumerate(_arch_flags()):
        fd, tmp = tempfile.mkstemp(prefix=".cpu_kernels-build-", suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            done = subprocess.run([*cmd, *_FLAGS, *arch, "-o", tmp, str(SOURCE), "-lm"],
                                  capture_output=True, text=True, timeout=300)
            if done.returncode == 0:
                os.chmod(tmp, 0o755)  # mkstemp creates 0600: others sharing the cache folder must load it too
                os.replace(tmp, target)
                if i:
                    warnings.warn(f"ckptq: built the C CPU kernels without {' '.join(_arch_flags()[0])} "
                                  f"({errors[0]}); they run, slower", RuntimeWarning, stacklevel=4)
                return None
            errors.append((done.stderr.strip().splitlines() or ["no error output"])[-1])
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return errors[-1]


def build_path(cmd: list[str]) -> Path:
    """Where the build for this source, compiler (and version), flags and CPU lives in the cache."""
    parts = (SOURCE.read_text(), " ".join(cmd), _compiler_version(cmd), " ".join(_FLAGS + _arch_flags()[0]),
             _cpu_signature())
    return cache_dir() / f"cpu_kernels-{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:16]}.so"


@functools.lru_cache(maxsize=1)
def _load() -> ctypes.CDLL | None:
    cmd = _compiler()
    if cmd is None:
        return _unavailable(f"no C compiler ({os.environ.get('CC') or 'cc'!r} not found; set CC)")
    target = build_path(cmd)
    try:
        if target.exists():
            try:
                return _bind(ctypes.CDLL(str(target)))
            except OSError:
                pass  # unreadable (another user's build) or damaged: build our own copy
        target.parent.mkdir(parents=True, exist_ok=True)
        error = _build(cmd, target)
        if error is not None:
            return _unavailable(f"compiling {SOURCE.name} failed: {error}")
        return _bind(ctypes.CDLL(str(target)))
    except (OSError, subprocess.SubprocessError) as exc:
        return _unavailable(f"{type(exc).__name__}: {exc}; set CKPTQ_CACHE_DIR to a writable folder")


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the exported functions' signatures (every one returns 0, or -1 for a bad block size)."""
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
