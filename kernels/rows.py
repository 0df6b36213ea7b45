"""The PyTorch reference of the row layout (``contract``, "Rows"), where rows are not whole blocks: the
codec and the step on a [rows, row_len] view, each row's whole blocks and its short last block stepped as
blocks of their own. Where rows are whole blocks the layout is the flat one and ``backend_torch`` takes
its flat path instead (same bits). Slow and plain on purpose: it states the layout; the C and Triton
kernels equal it bit for bit.
"""

from __future__ import annotations

import torch

from .contract import StepFlags, StepState, code_bytes, group_shape, layout_rows, num_blocks


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes uint8 [rows, row_len] (each below 2**bits) -> uint8 [rows, code_bytes(row_len, bits)], each row
    packed on its own as ``backend_torch.pack_codes`` packs a flat stream (zero bits after its last code)."""
    from .backend_torch import pack_codes

    rows, length = codes.shape
    if bits == 8:
        return codes.contiguous()
    g, w = group_shape(bits)
    padded = torch.nn.functional.pad(codes, (0, -length % g))  # whole groups per row: zero codes
    out = torch.empty(rows * padded.shape[1] * bits // 8, dtype=torch.uint8, device=codes.device)
    pack_codes(padded.reshape(-1), out, bits)
    return out.view(rows, -1)[:, : code_bytes(length, bits)]


def unpack_rows(packed: torch.Tensor, row_len: int, bits: int) -> torch.Tensor:
    """The inverse of ``pack_rows``: uint8 [rows, code_bytes(row_len, bits)] -> codes uint8 [rows, row_len]."""
    from .backend_torch import unpack_codes

    rows = packed.shape[0]
    if bits == 8:
        return packed
    g, w = group_shape(bits)
    padded_len = row_len + (-row_len % g)
    wide = torch.nn.functional.pad(packed, (0, padded_len * bits // 8 - packed.shape[1]))
    return unpack_codes(wide.reshape(-1), rows * padded_len, bits).view(rows, padded_len)[:, :row_len]


def _parts(row_len: int, block_size: int):
    """(columns, width) of a row's whole blocks and of its short last block, as they exist."""
    full = row_len - row_len % block_size
    parts = [(slice(0, full), block_size)] if full else []
    return parts + ([(slice(full, row_len), row_len - full)] if full < row_len else [])


def _blocks(t: torch.Tensor, cols: slice, width: int) -> torch.Tensor:
    """[rows, row_len] -> the columns ``cols`` as blocks [rows * (cols / width), width] (a copy)."""
    return t[:, cols].reshape(-1, width)


def quantize(x: torch.Tensor, thresholds, block_size: int, codes, absmax, bits: int, row_len: int) -> None:
    """x fp32 [n] (transform applied) -> codes [rows * row_bytes], absmax [rows * blocks_per_row]."""
    from .backend_torch import reference_codes

    rows, length = layout_rows(x.numel(), row_len)
    x2 = x.view(rows, length)
    c = torch.empty(rows, length, dtype=torch.uint8, device=x.device)
    a = absmax.view(rows, num_blocks(length, block_size))
    for cols, width in _parts(length, block_size):
        part_codes, part_absmax = reference_codes(_blocks(x2, cols, width).reshape(-1), thresholds, width)
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


def adam_step(p, g, states: tuple[StepState, ...], h, flags: StepFlags) -> None:
    """The fused step on the row layout: each row's whole blocks, then its short last block, as blocks."""
    from .backend_torch import step_rows

    rows, length = layout_rows(p.numel(), flags.row_len)
    p2, g2 = p.view(rows, length), g.view(rows, length)
    codes = [unpack_rows(s.codes.view(rows, -1), length, s.bits).clone() for s in states]
    absmax = [s.absmax.view(rows, -1) for s in states]
    index = torch.arange(p.numel(), dtype=torch.int64, device=p.device).view(rows, length)
    for cols, width in _parts(length, flags.block_size):
        b0, b1 = cols.start // flags.block_size, num_blocks(cols.stop, flags.block_size)
        views = tuple(s._replace(codes=_blocks(c, cols, width), absmax=a[:, b0:b1].reshape(-1))
                      for s, c, a in zip(states, codes, absmax))
        p_new, new = step_rows(_blocks(p2, cols, width), _blocks(g2, cols, width), h, views, flags.ratio,
                               flags.maximize, flags.seed, _blocks(index, cols, width))
        p2[:, cols] = p_new.view(rows, -1).to(p.dtype)
        for c, a, (new_codes, new_absmax) in zip(codes, absmax, new):
            c[:, cols] = new_codes.view(rows, -1)
            a[:, b0:b1] = new_absmax.view(rows, -1)
    for s, c in zip(states, codes):
        s.codes.view(rows, -1).copy_(pack_rows(c, s.bits))
