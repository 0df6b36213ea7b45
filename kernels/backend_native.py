"""The C backend: ``cpu_kernels.c`` (built and loaded by ``native``) called through ctypes on chunks of
whole blocks, on the CPU pool (ctypes releases the GIL for the length of a call).

Signatures and contract in ``contract``; results equal ``backend_torch`` bit for bit. ``ckptq.ops`` sends
work here only where the kernels can take it: CPU tensors of ``contract.KERNEL_DTYPES``, codebooks with
a code table (``usable``), the library loaded.
"""

from __future__ import annotations

import torch

from . import cpu_runtime, lut, memo, native
from .contract import KERNEL_DTYPES, StepFlags, StepState


def available() -> bool:
    return native.library() is not None


def why_unavailable() -> str:
    return native.why_unavailable()


def usable(thresholds: torch.Tensor) -> bool:
    """Whether the C kernels can write codes on the codebook of these thresholds (a code table exists)."""
    return memo.by_tensor(lut.native_code_table, thresholds) is not None


def _check(rc: int) -> None:
    # The kernels return -1 only for a block size outside 1..4096 or a code width other than 8, 6, 4, 2
    # (narrow widths with blocks that do not start on a byte), which ckptq.ops never passes.
    if rc != 0:
        raise RuntimeError(f"ckptq internal error: the C kernels refused their arguments (code {rc})")


def _decode_map(qmap: torch.Tensor) -> torch.Tensor:
    """The kernels' decode map: 256 fp32 entries (a smaller codebook padded with zeros: its codes never
    index the padding)."""
    if qmap.numel() == 256:
        return qmap
    return torch.cat([qmap, qmap.new_zeros(256 - qmap.numel())])


def _code_offset(start: int, bits: int) -> int:
    """Byte offset of element ``start``'s code (chunks are whole blocks: ``start`` is on a byte)."""
    return start * bits // 8


def quantize(src, thresholds, block_size: int, sqrt: bool, codes, absmax, bits: int = 8, row_len=None) -> None:
    lib, table = native.library(), lut.native_code_table(thresholds)
    dtype, size = KERNEL_DTYPES[src.dtype], src.element_size()

    def span(start: int, stop: int) -> None:
        _check(lib.ckq_quantize(src.data_ptr() + start * size, dtype, stop - start, block_size, sqrt,
                                table.data_ptr(), codes.data_ptr() + _code_offset(start, bits),
                                absmax.data_ptr() + 4 * (start // block_size), bits,
                                thresholds.data_ptr() if bits <= 4 else None))

    cpu_runtime.for_each_chunk(span, src.numel(), cpu_runtime.native_chunk(src.numel()), src.device)


def dequantize(codes, absmax, qmap, block_size: int, sqrt: bool, out, fresh: bool, bits: int = 8,
               row_len=None) -> None:
    lib, qmap = native.library(), _decode_map(qmap)

    def span(start: int, stop: int) -> None:
        _check(lib.ckq_dequantize(codes.data_ptr() + _code_offset(start, bits), absmax.data_ptr() + 4 * (start // block_size),
                                  qmap.data_ptr(), stop - start, block_size, sqrt, out.data_ptr() + 4 * start, fresh, bits))

    cpu_runtime.for_each_chunk(span, out.numel(), cpu_runtime.native_chunk(out.numel()), codes.device)


def adam_step(p, g, states: tuple[StepState, ...], h, flags: StepFlags) -> None:
    lib, block = native.library(), flags.block_size
    tables = [memo.by_tensor(lut.native_code_table, s.thresholds) for s in states]
    decode = [memo.by_tensor(_decode_map, s.qmap) for s in states]
    # the encode codebooks of stochastic rounding (first and second moment); None: to nearest
    rounding = [s.encode.data_ptr() if flags.seed is not None else None for s in states[:2]]
    thresholds = [s.thresholds.data_ptr() if s.bits <= 4 else None for s in states] + [None] * (3 - len(states))
    widths = [s.bits for s in states] + [states[1].bits] * (3 - len(states))
    n = p.numel()

    def span(start: int, stop: int) -> None:
        ptrs = [(s.codes.data_ptr() + _code_offset(start, s.bits), s.absmax.data_ptr() + 4 * (start // block),
                 q.data_ptr(), t.data_ptr()) for s, q, t in zip(states, decode, tables)]
        m, v, x = ptrs + [(None,) * 4] * (3 - len(ptrs))
        _check(lib.ckq_adam_step(p.data_ptr() + start * p.element_size(), KERNEL_DTYPES[p.dtype],
                                 g.data_ptr() + start * g.element_size(), KERNEL_DTYPES[g.dtype], stop - start, block,
                                 *m, flags.ratio, *v, *x, h.data_ptr(), flags.maximize, *widths, *rounding, start,
                                 flags.seed or 0, *thresholds))

    cpu_runtime.for_each_chunk(span, n, cpu_runtime.native_chunk(n), p.device)
