"""What the benchmarks in tools/bench/ share: interleaved rounds, medians and ratios, the markdown table, the
machine line, and the bytes an optimizer's state holds.

Interleaved rounds: every competitor runs once per round, and each round starts with a different one, so
that load from other processes on a shared machine hits all of them alike; figures are medians over rounds
and ratios are taken within one run. Importing this module loads nothing heavy (torch is imported by the
functions that need it), so a tool can import it before parsing its arguments.
"""

from __future__ import annotations

import os
import platform
import re
import statistics
import sys
import time
from typing import Callable


def timed(fn: Callable[[], object]) -> float:
    """Seconds of one ``fn()`` call (wall clock)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(runs: dict[str, Callable[[], float]], rounds: int, warmup: int = 1
                ) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Run every competitor ``warmup`` times, then ``rounds`` rounds of one call each, round r starting at
    the r-th competitor. ``runs`` maps a name to a function that does one unit of work and returns its
    seconds. Returns (the first call's seconds, the timed rounds' seconds) per name."""
    first = {name: run() for name, run in runs.items()}
    for _ in range(warmup - 1):
        for run in runs.values():
            run()
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            times[name].append(runs[name]())
    return first, times


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(ts) for name, ts in times.items()}


def ratio(value: float, base: float | None) -> str:
    """``value / base`` as ``1.23x``; ``-`` without a base."""
    return f"{value / base:.2f}x" if base else "-"


def markdown_table(head: list[str], rows: list[list[str]], left: int = 1) -> str:
    """A markdown table; the first ``left`` columns are text (left-aligned), the others numbers."""
    rule = "|" + "---|" * left + "---:|" * (len(head) - left)
    return "\n".join(["| " + " | ".join(head) + " |", rule] + ["| " + " | ".join(row) + " |" for row in rows])


def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform says."""
    names = re.findall(r"^model name\s*:\s*(.+)$", _cpuinfo(), re.M)
    return names[0].strip() if names else (platform.processor() or platform.machine())


def isa() -> str:
    """The vector extensions the C kernels can use here, as ``grep -o 'avx512[a-z_]*' /proc/cpuinfo`` lists
    them: ``AVX-512 (f, bw, ...)``, ``AVX2``, ``NEON``/``SVE`` on aarch64, or ``no AVX2``."""
    found = re.search(r"^(?:flags|Features)\s*:\s*(.+)$", _cpuinfo(), re.M)
    flags = set(found.group(1).split()) if found else set()
    avx512 = sorted(f[len("avx512"):].lstrip("_") for f in flags if f.startswith("avx512"))
    if avx512:
        return f"AVX-512 ({', '.join(avx512)})"
    if "avx2" in flags:
        return "AVX2"
    if "asimd" in flags or platform.machine() in ("aarch64", "arm64"):
        return "SVE" if "sve" in flags else "NEON"
    return "no AVX2"


def machine_line() -> str:
    """One line naming the machine: CPU, its vector ISA, CPUs this process may use, torch and its threads
    (when torch is loaded)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    line = f"{cpu_model()}, {isa()}, {usable} of {os.cpu_count()} CPUs usable"
    torch = sys.modules.get("torch")
    if torch is not None:
        line += f"; torch {torch.__version__} with {torch.get_num_threads()} threads"
        if torch.cuda.is_available():
            line += f"; {torch.cuda.get_device_name()}"
    return line


def set_threads(threads: int | None) -> None:
    """Pin torch's intra-op threads (and OpenMP's, for libraries that read it when they load)."""
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        import torch

        torch.set_num_threads(threads)


def _storages(obj, seen: dict[int, int]) -> None:
    """Collect {storage data_ptr: nbytes} of every tensor reachable from ``obj`` (dicts, lists, subclasses)."""
    import torch

    if isinstance(obj, dict):
        for value in obj.values():
            _storages(value, seen)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _storages(value, seen)
    elif isinstance(obj, torch.Tensor):
        attrs = getattr(obj, "tensor_attrs", None)  # torchao OptimState8bit: codes u8, scale fp32, qmap fp32
        if attrs is not None and type(obj) is not torch.Tensor:
            for attr in attrs:
                _storages(getattr(obj, attr), seen)
            return
        storage = obj.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()


def state_bytes(opt) -> int:
    """Bytes held by an optimizer's state, each storage once (0-dim step tensors and shared codebooks
    included; torchao's tensor subclasses opened to their codes, scales and maps)."""
    seen: dict[int, int] = {}
    for state in opt.state.values():
        _storages(state, seen)
    return sum(seen.values())
