"""Blockwise 8-bit quantization: codebooks, and the PyTorch reference of quantize/dequantize.

A tensor is flattened and cut into blocks of ``block_size`` values (the last block may be short).
Each block is divided by its absmax (an fp32 scale), and every normalized value in [-1, 1] is
rounded to the nearest entry of a sorted 256-entry codebook; the code is that entry's index.
Method: Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (ICLR 2022).

Rounding rule (the contract the Triton kernels reproduce bit for bit): with ``t = midpoints(qmap)``
(255 fp32 values ``(q[i] + q[i+1]) / 2``), ``code = #{j : t[j] < y}`` where ``y = x / absmax`` is an
IEEE fp32 division. Ties go to the lower code. An all-zero block gets absmax 0 and the code of 0.

Transforms change what is stored, not how: ``"sqrt"`` stores ``sqrt(x)`` (x >= 0, for second
moments: it halves the number of decades the codebook must span) and decodes ``s * s``.

The PyTorch functions here are the reference and the CPU path where C is unavailable; ``backend="native"``
(the CPU default when it builds) runs ``ckptq.kernels.cpu_kernels.c``, ``backend="triton"`` (the CUDA
default) the kernels in ``ckptq.kernels.quant``, with identical signatures and results.
"""

from __future__ import annotations

import functools
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from .errors import UsageError
from .kernels import native

BLOCK_SIZES = tuple(2**k for k in range(6, 13))  # 64 ... 4096
DEFAULT_BLOCK_SIZE = 256
TRANSFORMS = ("none", "sqrt")
BACKENDS = ("auto", "torch", "native", "triton")
# CPU chunks: 256K elements (1 MB fp32), the fastest of 2^15..2^20 measured on 2 cores with 2 MB L2
# each, and a multiple of every block size. Other devices take big chunks: they only bound memory.
_CPU_CHUNK = 1 << 18
_DEVICE_CHUNK = 1 << 24
_NATIVE_CHUNK_MIN, _NATIVE_CHUNK_MAX = 1 << 16, 1 << 21
_SIGN_FLIP = 1 << 15  # (int32 bits >> 16) is in [-2^15, 2^15); adding this makes it a table index


def midpoints(qmap: torch.Tensor) -> torch.Tensor:
    """Decision thresholds between neighbouring codebook entries: 255 fp32 values."""
    q = qmap.to(torch.float32)
    return (q[:-1] + q[1:]) / 2.0


def check_block_size(block_size: int) -> int:
    if block_size not in BLOCK_SIZES:
        raise UsageError(f"block size {block_size} is not supported; use a power of two from 64 to 4096")
    return block_size


def check_codebook(qmap: torch.Tensor) -> None:
    """UsageError unless ``qmap`` is a 1-D float tensor of 256 entries."""
    if not isinstance(qmap, torch.Tensor) or not qmap.is_floating_point() or qmap.shape != (256,):
        got = f"{qmap.dtype} {tuple(qmap.shape)}" if isinstance(qmap, torch.Tensor) else type(qmap).__name__
        raise UsageError(f"codebook must be a float tensor of 256 entries, got {got}")


def check_quantized(codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor, block_size: int) -> None:
    """UsageError unless codes are uint8, absmax holds one float scale per block of ``block_size`` codes on the
    same device, and ``qmap`` is a 256-entry codebook: what every dequantize path relies on."""
    check_block_size(block_size)
    check_codebook(qmap)
    if codes.dtype != torch.uint8:
        raise UsageError(f"codes must be uint8, got {codes.dtype}")
    n_blocks = num_blocks(codes.numel(), block_size)
    if not absmax.is_floating_point() or absmax.numel() != n_blocks:
        raise UsageError(
            f"absmax must be float with {n_blocks} entries for {codes.numel()} codes in blocks of {block_size}, "
            f"got {absmax.dtype} with {absmax.numel()}; pass the absmax that quantize_blockwise returned"
        )
    if absmax.device != codes.device:
        raise UsageError(f"codes are on {codes.device} but absmax is on {absmax.device}; move them together")


def num_blocks(numel: int, block_size: int) -> int:
    return (numel + block_size - 1) // block_size


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto`` -> ``triton`` on CUDA, ``native`` (the C kernels) on the CPU when they could be built,
    else ``torch``. An explicit ``native`` that cannot run raises UsageError saying why."""
    if backend not in BACKENDS:
        raise UsageError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "auto":
        if device.type == "cuda":
            return "triton"
        return "native" if device.type == "cpu" and native.library() is not None else "torch"
    if backend == "native":
        if device.type != "cpu":
            raise UsageError(f"backend 'native' runs on the CPU, not on {device}; use 'auto'")
        if native.library() is None:
            raise UsageError(f"backend 'native' is unavailable: {native.why_unavailable()}")
    return backend


def _check_transform(transform: str) -> None:
    if transform not in TRANSFORMS:
        raise UsageError(f"transform {transform!r} is not one of {', '.join(TRANSFORMS)}")


def reference_codes(x: torch.Tensor, thresholds: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rounding contract written out plainly. x: fp32 [n] (transform already applied).

    Returns codes uint8 [n] and absmax fp32 [ceil(n / block_size)]. The fast path uses it for a
    tensor's last, short block and for codebooks the lookup table cannot serve.
    """
    n = x.numel()
    nb = num_blocks(n, block_size)
    blocks = torch.nn.functional.pad(x, (0, nb * block_size - n)).view(nb, block_size)  # zeros never win absmax
    absmax = blocks.abs().amax(dim=1)  # [nb]
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    y = blocks / safe[:, None]  # IEEE division, as the kernels do
    codes = torch.searchsorted(thresholds, y, right=False, out_int32=True)  # #{t < y}
    return codes.view(-1)[:n].to(torch.uint8), absmax


# Code lookup table. Every fp32 y falls in one of 2^16 buckets: the floats that share y's top 16 bits
# (sign, exponent, 7 mantissa bits), a closed interval [lo_b, hi_b]. With base_b = #{t < lo_b}, and
# thresholds t sorted, #{t < y} = base_b + #{j : lo_b <= t[j] < y}. When at most one threshold lies in
# [lo_b, hi_b] it can only be t[base_b] (the first one >= lo_b; if that lies above hi_b it lies above y
# too), so code = base_b + (t[base_b] < y): one table lookup and one exact fp32 compare, the answer of
# searchsorted for every y. Codebooks with two thresholds in one bucket get no table and take
# searchsorted. NaN buckets map to 255, as searchsorted does (y is never a signalling NaN: it comes out
# of a division). tests/test_codec.py checks both ends of every bucket and every threshold +-1 ulp.
class _CodeTable:
    def __init__(self, base: torch.Tensor, thr: torch.Tensor):
        self.base = base  # uint8 [65536], indexed by (bits of y >> 16) + 2^15
        self.thr = thr  # fp32 [65536]: t[base], +inf when base is 255


def _bucket_bounds() -> tuple[torch.Tensor, torch.Tensor]:
    """lo, hi: fp32 [65536], the smallest and largest value of each bucket, in table order."""
    top = torch.arange(-_SIGN_FLIP, _SIGN_FLIP, dtype=torch.int64)  # signed top 16 bits
    zero_low = (top << 16).to(torch.int32).view(torch.float32)
    ones_low = ((top << 16) | 0xFFFF).to(torch.int32).view(torch.float32)
    negative = top < 0  # larger low bits mean more negative
    lo = torch.where(negative, ones_low, zero_low)
    hi = torch.where(negative, zero_low, ones_low)
    special = ((top >> 7) & 0xFF) == 0xFF  # exponent 255: +-inf (mantissa 0, in lo) or NaN
    nan = special & ((top & 0x7F) != 0)
    lo = torch.where(special, zero_low, lo).masked_fill(nan, float("nan"))
    hi = torch.where(special, zero_low, hi).masked_fill(nan, float("nan"))
    return lo, hi


@functools.lru_cache(maxsize=16)
def _code_table_cpu(threshold_bytes: bytes) -> _CodeTable | None:
    t = torch.frombuffer(bytearray(threshold_bytes), dtype=torch.float32)  # [255]
    lo, hi = _bucket_bounds()
    base = torch.searchsorted(t, lo)  # #{t < lo}; NaN -> 255
    inside = torch.searchsorted(t, hi, right=True) - base  # #{t in [lo, hi]}; 0 for NaN buckets
    if bool((inside > 1).any()):
        return None
    t_ext = torch.cat([t, torch.full((1,), float("inf"))])  # [256]: t[255] = +inf never compares below y
    return _CodeTable(base.to(torch.uint8), t_ext[base])


def _code_table(thresholds: torch.Tensor) -> _CodeTable | None:
    table = _code_table_cpu(thresholds.cpu().numpy().tobytes())
    if table is None or thresholds.device.type == "cpu":
        return table
    return _CodeTable(table.base.to(thresholds.device), table.thr.to(thresholds.device))


class _Workspace:
    """Scratch buffers for one chunk; one per CPU thread, reused across calls."""

    def __init__(self, chunk: int, device: torch.device):
        self.x = torch.empty(chunk, dtype=torch.float32, device=device)  # converted input, later thresholds
        self.y = torch.empty(chunk, dtype=torch.float32, device=device)  # x / absmax
        self.idx = torch.empty(chunk, dtype=torch.int32, device=device)  # table index / codes as int32
        self.gt = torch.empty(chunk, dtype=torch.bool, device=device)


_local = threading.local()


def _workspace(device: torch.device, chunk: int) -> _Workspace:
    if device.type != "cpu":
        return _Workspace(chunk, device)
    ws = getattr(_local, "workspace", None)
    if ws is None or ws.y.numel() < chunk:
        ws = _local.workspace = _Workspace(chunk, device)
    return ws


_pool_state: dict = {}


def _worker_init() -> None:
    torch.set_num_threads(1)  # per-thread under OpenMP: the chunks are the parallelism, no nested teams


def _workers() -> int:
    """CPU threads for chunked work: torch's thread count, at most one per core."""
    return max(1, min(os.cpu_count() or 1, torch.get_num_threads()))


def _pool() -> ThreadPoolExecutor | None:
    """A small thread pool for CPU chunks (torch ops release the GIL), rebuilt after a fork."""
    workers = _workers()
    if workers < 2:
        return None
    key = (os.getpid(), workers)
    if _pool_state.get("key") != key:
        _pool_state["pool"] = ThreadPoolExecutor(workers, "ckptq-codec", initializer=_worker_init)
        _pool_state["key"] = key
    return _pool_state["pool"]


def native_chunk(n: int) -> int:
    """Elements per call of the C kernels: about four chunks per worker for balance, whole 4096-blocks,
    between 64K and 2M elements (larger chunks measured faster on fresh output: fewer, larger prefaults)."""
    per = -(-n // (4 * _workers()))
    return min(_NATIVE_CHUNK_MAX, max(_NATIVE_CHUNK_MIN, -(-per // 4096) * 4096))


def _for_each_chunk(fn, n: int, device: torch.device, chunk: int | None = None, workspace: bool = True) -> None:
    """Call fn(start, stop, workspace) over [0, n) in chunks, on the CPU pool when there are several.
    ``chunk`` defaults to the PyTorch path's; ``workspace=False`` passes None (the C kernels need none)."""
    chunk = chunk or (_CPU_CHUNK if device.type == "cpu" else _DEVICE_CHUNK)
    spans = [(s, min(s + chunk, n)) for s in range(0, n, chunk)]
    pool = _pool() if device.type == "cpu" and len(spans) > 1 else None

    def run(span: tuple[int, int]) -> None:
        fn(*span, _workspace(device, min(chunk, n)) if workspace else None)

    if pool is None:
        for span in spans:
            run(span)
    else:
        list(pool.map(run, spans))


def _native_for(t: torch.Tensor, backend: str):
    """The C kernels for backend ``native`` when t is a contiguous CPU tensor; else None: PyTorch."""
    return native.library() if backend == "native" and t.device.type == "cpu" and t.is_contiguous() else None


def ieee_sqrt(x: torch.Tensor) -> torch.Tensor:
    """sqrt(x) as a new fp32 tensor, correctly rounded (see ``ieee_sqrt_into``)."""
    return ieee_sqrt_into(x, torch.empty(x.shape, dtype=torch.float32, device=x.device))


def ieee_sqrt_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = sqrt(x) in fp32, correctly rounded (as the kernels' sqrt_rn); x any float dtype, out fp32.
    torch's CPU fp32 sqrt is 1 ulp off on ~20% of inputs, numpy's is IEEE, and so is CUDA's sqrtf."""
    if out.device.type != "cpu":
        return torch.sqrt(x.float(), out=out)
    if x.dtype != torch.float32:
        x = out.copy_(x)
    np.sqrt(x.numpy(), out=out.numpy())
    return out


def _as_fp32(src: torch.Tensor, buf: torch.Tensor, transform: str) -> torch.Tensor:
    """src: [n] any float dtype -> fp32 [n], sqrt applied; uses buf [n] unless src can be used as is."""
    if transform == "sqrt":
        return ieee_sqrt_into(src, buf)
    return buf.copy_(src) if src.dtype != torch.float32 else src


def _absmax_rows(blocks: torch.Tensor, out: torch.Tensor, nonnegative: bool = False) -> None:
    """out[i] = max |blocks[i, :]| for blocks [nb, B]. Two reductions beat abs() + amax (no full temp),
    and sqrt outputs (``nonnegative``: >= 0, -0.0 or NaN) need only the max; abs_ turns a -0.0 from an
    all-zero block into the +0.0 that abs().amax gives."""
    torch.amax(blocks, dim=1, out=out)
    if not nonnegative:
        torch.maximum(out, torch.amin(blocks, dim=1).neg_(), out=out)
    out.abs_()


def _lookup_codes(y: torch.Tensor, table: _CodeTable, codes: torch.Tensor, ws: _Workspace) -> None:
    """codes [n] uint8 = #{t < y} for y fp32 [n], via the table (see _CodeTable)."""
    n = y.numel()
    idx = torch.bitwise_right_shift(y.view(torch.int32), 16, out=ws.idx[:n]).add_(_SIGN_FLIP)
    torch.index_select(table.base, 0, idx, out=codes)
    thr = torch.index_select(table.thr, 0, idx, out=ws.x[:n])
    codes.add_(torch.gt(y, thr, out=ws.gt[:n]))


def _quantize_span(src, codes, absmax, thresholds, table, block_size, transform, ws) -> None:
    """Quantize src [n] into codes [n] and absmax [ceil(n / B)] (views of the outputs); n <= chunk."""
    n = src.numel()
    x = _as_fp32(src, ws.x[:n], transform)
    full = n - n % block_size
    nb = full // block_size
    if nb:
        blocks = x[:full].view(nb, block_size)
        _absmax_rows(blocks, absmax[:nb], nonnegative=transform == "sqrt")
        safe = torch.where(absmax[:nb] > 0, absmax[:nb], 1.0)
        y = torch.div(blocks, safe[:, None], out=ws.y[:full].view(nb, block_size)).view(-1)
        _lookup_codes(y, table, codes[:full], ws)
    if full < n:  # the tensor's last, short block
        codes[full:], absmax[nb:] = reference_codes(x[full:], thresholds, block_size)


def quantize_rows(x: torch.Tensor, thresholds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 blocks [nb, B] (transform applied) -> (codes uint8 [nb, B], absmax fp32 [nb]) in PyTorch on x's
    device and thread, through the lookup table where the codebook has one (``reference_codes`` otherwise):
    the building block of the optimizer's PyTorch step."""
    nb, block = x.shape
    table = _code_table(thresholds)
    if table is None or x.numel() > _CPU_CHUNK:
        codes, absmax = reference_codes(x.reshape(-1), thresholds, block)
        return codes.view(nb, block), absmax
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    absmax = torch.empty(nb, dtype=torch.float32, device=x.device)
    _quantize_span(x.reshape(-1), codes.view(-1), absmax, thresholds, table, block, "none",
                   _workspace(x.device, _CPU_CHUNK))
    return codes, absmax


def quantize_blockwise(
    x: torch.Tensor,
    qmap: torch.Tensor,
    block_size: int = DEFAULT_BLOCK_SIZE,
    transform: str = "none",
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (any float dtype and shape) blockwise.

    Returns ``(codes, absmax)``: ``codes`` uint8 of shape ``[x.numel()]`` and ``absmax`` fp32 of
    shape ``[ceil(numel / block_size)]``, both on ``x.device``. NaN/Inf inputs are not checked here
    (callers keep such tensors exact); ``transform="sqrt"`` requires ``x >= 0``.
    """
    check_block_size(block_size)
    check_codebook(qmap)
    _check_transform(transform)
    qmap = qmap.to(torch.float32)
    resolved = resolve_backend(backend, x.device)
    if resolved == "triton":
        from .kernels import quant

        return quant.quantize_blockwise(x, qmap, block_size, transform)
    flat = x.detach().reshape(-1)  # converted to fp32 chunk by chunk: no full-size copy
    thresholds = midpoints(qmap.to(flat.device))
    table = _code_table(thresholds)
    n = flat.numel()
    on_cpu = flat.device.type == "cpu"
    codes = new_cpu_buffer(n, torch.uint8) if on_cpu else torch.empty(n, dtype=torch.uint8, device=flat.device)
    absmax = torch.empty(num_blocks(n, block_size), dtype=torch.float32, device=flat.device)
    lib = _native_for(flat, resolved)
    native_table = native.code_table(thresholds) if lib is not None and flat.dtype in native.DTYPE_CODES else None

    def span(start: int, stop: int, ws: _Workspace) -> None:
        if native_table is not None:
            src = flat.data_ptr() + start * flat.element_size()
            b0 = start // block_size
            native.check(lib.ckq_quantize(src, native.DTYPE_CODES[flat.dtype], stop - start, block_size,
                                          transform == "sqrt", native_table.data_ptr(), codes.data_ptr() + start,
                                          absmax.data_ptr() + 4 * b0))
            return
        c, a = codes[start:stop], absmax[start // block_size : num_blocks(stop, block_size)]
        if table is None:
            x32 = _as_fp32(flat[start:stop], ws.x[: stop - start], transform)
            c[:], a[:] = reference_codes(x32, thresholds, block_size)
        else:
            _quantize_span(flat[start:stop], c, a, thresholds, table, block_size, transform, ws)

    if native_table is not None:
        _for_each_chunk(span, n, flat.device, native_chunk(n), workspace=False)
    else:
        _for_each_chunk(span, n, flat.device)
    return codes, absmax


@functools.lru_cache(maxsize=16)
def _pair_table_cpu(qmap_bytes: bytes) -> torch.Tensor:
    """[65536] float64 whose 8 bytes are the fp32 pair (qmap[i & 255], qmap[i >> 8]): one gather
    decodes two codes (little-endian: the first code is the low byte of a uint16)."""
    q = torch.frombuffer(bytearray(qmap_bytes), dtype=torch.float32)
    pairs = torch.stack([q.repeat(256), q.repeat_interleave(256)], dim=1)  # [65536, 2]: (low, high)
    return pairs.contiguous().view(torch.float64).reshape(-1)


def _gather_codes(codes: torch.Tensor, qmap: torch.Tensor, out: torch.Tensor, ws: _Workspace) -> None:
    """out [n] = qmap[codes] for codes uint8 [n]; two codes per gather on the CPU when aligned."""
    n = codes.numel()
    if codes.device.type == "cpu" and n % 2 == 0 and codes.storage_offset() % 2 == 0 and codes.is_contiguous():
        pairs = codes.view(torch.int16)
        idx = ws.idx[: n // 2].copy_(pairs).bitwise_and_(0xFFFF)  # sign-extended int16 -> 0..65535
        table = _pair_table_cpu(qmap.cpu().numpy().tobytes())
        torch.index_select(table, 0, idx, out=out.view(torch.float64))
        return
    idx = ws.idx[:n].copy_(codes)  # index_select takes int32 indices: no int64 temporary
    torch.index_select(qmap, 0, idx, out=out)


def _dequantize_span(codes, absmax, qmap, out, block_size, transform, ws) -> None:
    """out [n] = qmap[codes] * absmax[block] (then squared for "sqrt"); codes uint8 [n], n <= chunk."""
    n = codes.numel()
    _gather_codes(codes, qmap, out, ws)
    full = n - n % block_size
    nb = full // block_size
    out[:full].view(nb, block_size).mul_(absmax[:nb, None])
    if full < n:
        out[full:].mul_(absmax[nb])
    if transform == "sqrt":
        out.mul_(out)  # v * v in fp32, as the kernels do


_HUGE_MIN_BYTES = 8 << 20


def new_cpu_buffer(n: int, dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(n, dtype) on the CPU; large buffers come from an anonymous mapping advised to use
    transparent huge pages. A fresh 64 MB output is otherwise dominated by the kernel faulting in and
    zeroing 16,384 small pages: measured here 35 ms to allocate and fill 64 MB with 4 KB pages, 16 ms
    with huge pages, and dequantize 50 -> 18 ms. Freed with the tensor (the storage owns the mapping);
    the tensor cannot be resized. Falls back to torch.empty where madvise is unavailable."""
    nbytes = n * dtype.itemsize
    if nbytes < _HUGE_MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(n, dtype=dtype)
    try:
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError, AttributeError):
        return torch.empty(n, dtype=dtype)
    return torch.frombuffer(m, dtype=dtype, count=n)


def output_buffer(out: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    """``out`` checked as a contiguous fp32 [n] tensor on ``device`` (flattened), or a new one."""
    if out is None:
        if device.type == "cpu":
            return new_cpu_buffer(n, torch.float32)
        return torch.empty(n, dtype=torch.float32, device=device)
    if out.dtype != torch.float32 or out.numel() != n or not out.is_contiguous() or out.device != device:
        raise UsageError(f"out must be a contiguous float32 tensor of {n} elements on {device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    return out.view(-1)


def dequantize_blockwise(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    qmap: torch.Tensor,
    block_size: int = DEFAULT_BLOCK_SIZE,
    transform: str = "none",
    backend: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise`: fp32 tensor of shape ``[codes.numel()]``.

    Value = ``qmap[code] * absmax[block]``, squared afterwards when ``transform == "sqrt"``. With
    ``out`` (a contiguous fp32 tensor of ``codes.numel()`` elements on the codes' device) the result
    is written there: reusing a buffer saves the page faults of a fresh allocation.
    """
    check_quantized(codes, absmax, qmap, block_size)
    _check_transform(transform)
    qmap = qmap.to(torch.float32)
    resolved = resolve_backend(backend, codes.device)
    if resolved == "triton":
        from .kernels import quant

        return quant.dequantize_blockwise(codes, absmax, qmap, block_size, transform, out)
    flat = codes.reshape(-1)
    qmap = qmap.to(device=flat.device, dtype=torch.float32).contiguous()
    absmax = absmax.to(device=flat.device, dtype=torch.float32).reshape(-1).contiguous()
    fresh = out is None
    out = output_buffer(out, flat.numel(), flat.device)
    lib = _native_for(flat, resolved)

    def span(start: int, stop: int, ws: _Workspace) -> None:
        a = absmax[start // block_size : num_blocks(stop, block_size)]
        if lib is not None:
            native.check(lib.ckq_dequantize(flat.data_ptr() + start, a.data_ptr(), qmap.data_ptr(), stop - start,
                                            block_size, transform == "sqrt", out.data_ptr() + 4 * start, fresh))
            return
        _dequantize_span(flat[start:stop], a, qmap, out[start:stop], block_size, transform, ws)

    if lib is not None:
        _for_each_chunk(span, flat.numel(), flat.device, native_chunk(flat.numel()), workspace=False)
    else:
        _for_each_chunk(span, flat.numel(), flat.device)
    return out
