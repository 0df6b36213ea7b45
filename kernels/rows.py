"""The PyTorch reference of the row layout (``contract``, "Rows"), where rows are not whole blocks: the
codec and the step on a [rows, row_len] view, each row's whole blocks and its short last block stepped as
blocks of their own. Where rows are whole blocks the layout is the flat one and ``backend_torch`` takes
its flat path instead (same bits). Slow and plain on purpose: it states the layout; the C and Triton
kernels equal it bit for bit.
"""

from __future__ import annotations

import torch

from .contract import layout_rows, num_blocks
from .reference import pack_rows, reference_codes, unpack_rows


def parts(row_len: int, block_size: int):
    """(columns, width) of a row's whole blocks and of its short last block, as they exist."""
    full = row_len - row_len % block_size
    parts = [(slice(0, full), block_size)] if full else []
    return parts + ([(slice(full, row_len), row_len - full)] if full < row_len else [])


def blocks(t: torch.Tensor, cols: slice, width: int) -> torch.Tensor:
    """[rows, row_len] -> the columns ``cols`` as blocks [rows * (cols / width), width] (a copy)."""
    return t[:, cols].reshape(-1, width)


def quantize(x: torch.Tensor, thresholds, block_size: int, codes, absmax, bits: int, row_len: int) -> None:
    """x fp32 [n] (transform applied) -> codes [rows * row_bytes], absmax [rows * blocks_per_row]."""
    rows, length = layout_rows(x.numel(), row_len)
    x2 = x.view(rows, length)
    c = torch.empty(rows, length, dtype=torch.uint8, device=x.device)
    a = absmax.view(rows, num_blocks(length, block_size))
    for cols, width in parts(length, block_size):
        part_codes, part_absmax = reference_codes(blocks(x2, cols, width).reshape(-1), thresholds, width)
        c[:, cols] = part_codes.view(rows, -1)
        a[:, cols.start // block_size : num_blocks(cols.stop, block_size)] = part_absmax.view(rows, -1)
    codes.view(rows, -1).copy_(pack_rows(c, bits))


def dequantize(codes, absmax, qmap, block_size: int, out, bits: int, row_len: int) -> None:
    """out fp32 [n] = qmap[code] * absmax[row, column // block_size] (no transform)."""
    rows, length = layout_rows(out.numel(), row_len)
    c = unpack_rows(codes.view(rows, -1), length, bits).to(torch.int64)
    scale_index = torch.arange(length, device=codes.device) // block_size
    scales = absmax.view(rows, -1)[:, scale_index]  # [rows, row_len]
    out.view(rows, length).copy_(qmap[c] * scales)


#END
