"""The CPU runtime of the backends: a thread pool over chunks of whole blocks, per-thread scratch
buffers, and large outputs on transparent huge pages.

Chunks touch disjoint blocks, and both torch ops and ctypes calls release the GIL, so a tensor's chunks
run in parallel on a small pool of single-threaded workers (an OpenMP team per small op would cost a
barrier each).
"""

from __future__ import annotations

import functools
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

# Chunks of the PyTorch backend: 256K elements (1 MB fp32), the fastest of 2^15..2^20 measured on 2 cores
# with 2 MB L2 each, and a multiple of every block size. Other devices take big chunks: they only bound
# memory.
CPU_CHUNK = 1 << 18
DEVICE_CHUNK = 1 << 24
_NATIVE_CHUNK_MIN, _NATIVE_CHUNK_MAX = 1 << 16, 1 << 21
HUGE_MIN_BYTES = 8 << 20


class Workspace:
    """Scratch buffers for one chunk of the PyTorch backend; one per CPU thread, reused across calls."""

    def __init__(self, chunk: int, device: torch.device):
        self.x = torch.empty(chunk, dtype=torch.float32, device=device)  # converted input, later thresholds
        self.y = torch.empty(chunk, dtype=torch.float32, device=device)  # x / absmax
        self.idx = torch.empty(chunk, dtype=torch.int32, device=device)  # table index / codes as int32
        self.gt = torch.empty(chunk, dtype=torch.bool, device=device)


_local = threading.local()


def workspace(device: torch.device, chunk: int) -> Workspace:
    """This thread's workspace of at least ``chunk`` elements (a fresh one off the CPU)."""
    if device.type != "cpu":
        return Workspace(chunk, device)
    ws = getattr(_local, "workspace", None)
    if ws is None or ws.y.numel() < chunk:
        ws = _local.workspace = Workspace(chunk, device)
    return ws


_pool_state: dict = {}


def _worker_init() -> None:
    torch.set_num_threads(1)  # per-thread under OpenMP: the chunks are the parallelism, no nested teams


@functools.lru_cache(maxsize=None)
def _cores() -> int:
    return os.cpu_count() or 1


def workers() -> int:
    """CPU threads for chunked work: torch's thread count, at most one per core."""
    return max(1, min(_cores(), torch.get_num_threads()))


def _pool() -> ThreadPoolExecutor | None:
    """A small thread pool for CPU chunks, rebuilt after a fork."""
    n = workers()
    if n < 2:
        return None
    key = (os.getpid(), n)
    if _pool_state.get("key") != key:
        _pool_state["pool"] = ThreadPoolExecutor(n, "ckptq-cpu", initializer=_worker_init)
        _pool_state["key"] = key
    return _pool_state["pool"]


def native_chunk(n: int) -> int:
    """Elements per call of the C kernels: about four chunks per worker for balance, whole 4096-blocks,
    between 64K and 2M elements (larger chunks measured faster on fresh output: fewer, larger prefaults)."""
    per = -(-n // (4 * workers()))
    return min(_NATIVE_CHUNK_MAX, max(_NATIVE_CHUNK_MIN, -(-per // 4096) * 4096))


def for_each_chunk(fn: Callable[[int, int], None], n: int, chunk: int, device: torch.device) -> None:
    """Call fn(start, stop) over [0, n) in chunks of ``chunk`` (a multiple of the block size), on the
    CPU pool when there are several."""
    spans = [(s, min(s + chunk, n)) for s in range(0, n, chunk)]
    pool = _pool() if device.type == "cpu" and len(spans) > 1 else None
    if pool is None:
        for span in spans:
            fn(*span)
    else:
        list(pool.map(lambda span: fn(*span), spans))


def run_on_workers(fn: Callable[[], None], count: int) -> None:
    """fn() on ``count`` threads at once (this one and count - 1 of the pool: at most ``workers()``),
    returning when all have; an exception in any is raised here."""
    pool = _pool() if count > 1 else None
    if pool is None:
        fn()
        return
    futures = [pool.submit(fn) for _ in range(min(count, workers()) - 1)]
    try:
        fn()
    finally:
        for future in futures:
            future.result()


def new_buffer(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty(n, dtype, device); large CPU buffers come from an anonymous mapping advised to use
    transparent huge pages. A fresh 64 MB output is otherwise dominated by the kernel faulting in and
    zeroing 16,384 small pages: measured here 35 ms to allocate and fill 64 MB with 4 KB pages, 16 ms
    with huge pages, and dequantize 50 -> 18 ms. Freed with the tensor (the storage owns the mapping);
    the tensor cannot be resized. Falls back to torch.empty where madvise is unavailable."""
    nbytes = n * dtype.itemsize
    if device.type != "cpu" or nbytes < HUGE_MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(n, dtype=dtype, device=device)
    try:
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError, AttributeError):
        return torch.empty(n, dtype=dtype)
    return torch.frombuffer(m, dtype=dtype, count=n)
