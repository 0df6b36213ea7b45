"""The PyTorch reference of the one-state step (SGD, Lion, Muon; ``contract.MOMENTUM_FIELDS``), and its path
wherever the C and Triton kernels are not: blocks of the row layout gathered into the rows of a
[blocks, block_size] tile (a short block's missing lanes zero, which never win its absmax and are never
written back), decoded, updated in fp32 (``momentum_math``), requantized (to nearest through the code table,
or stochastically with the step's hash, as ``backend_torch`` does for Adam), and written back where the layout
keeps each block's codes and scale."""

from __future__ import annotations

import torch

from .backend_torch import STEP_CHUNK, on_device, quantize_rows, stochastic_codes, uniforms
from .contract import (UPDATE_NONE, UPDATE_SIGN, MomentumFlags, MomentumGroup, StepState, code_bytes, layout_blocks,
                       layout_rows, momentum_steps, num_blocks, pack_codes, unpack_codes)



def _block_tile(b0: int, b1: int, n: int, row_len: int | None, block_size: int, bits: int, device):
    """Blocks b0 .. b1 - 1 of n elements in rows of ``row_len``: (element index int64 [nb, B], -1 where a block
    is short; code byte index int64 [nb, B * bits / 8], -1 past a short block's last byte)."""
    rows, length = layout_rows(n, row_len)
    per_row = num_blocks(length, block_size)
    b = torch.arange(b0, b1, dtype=torch.int64, device=device)
    r, col0 = b // per_row, (b % per_row) * block_size
    e = col0[:, None] + torch.arange(block_size, dtype=torch.int64, device=device)[None, :]
    index = torch.where(e < length, r[:, None] * length + e, -1)
    width = block_size * bits // 8
    k = torch.arange(width, dtype=torch.int64, device=device)[None, :]
    used = (torch.clamp(length - col0, max=block_size) * bits + 7) // 8  # code_bytes of each block
    byte = torch.where(k < used[:, None], (r * code_bytes(length, bits) + col0 * bits // 8)[:, None] + k, -1)
    return index, byte


def _take(t: torch.Tensor, index: torch.Tensor, fill=0) -> torch.Tensor:
    """t[index] with ``fill`` where index is -1 (t flat)."""
    return torch.where(index >= 0, t[index.clamp(min=0)], torch.full((), fill, dtype=t.dtype, device=t.device))


def _put(t: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """t[index] = values where index is not -1 (t flat)."""
    keep = index >= 0
    t[index[keep]] = values[keep].to(t.dtype)


def _sign(x: torch.Tensor) -> torch.Tensor:
    """sign(x) in fp32: -1, 0 or 1, NaN for NaN (torch.sign alone gives 0 for NaN)."""
    return torch.where(torch.isnan(x), x, torch.sign(x))


def momentum_math(p, g, m, h, maximize: bool, update: int):
    """The one-state update on fp32 tensors of one shape (``contract.MOMENTUM_FIELDS``); ``h`` fp32 [8] on
    their device. Returns (p or None when ``update`` is UPDATE_NONE, m_new, d)."""
    if maximize:
        g = -g
    g = g + h[0] * p
    m_new = m * h[1] + h[2] * g
    d = (m * h[3] + m_new * h[4]) + g * h[5]
    if update == UPDATE_NONE:
        return None, m_new, d
    return p * h[6] + h[7] * (_sign(d) if update == UPDATE_SIGN else d), m_new, d


def _momentum_span(p, g, state: StepState, h, out, flags: MomentumFlags, b0: int, b1: int) -> None:
    n = p.numel()
    index, byte = _block_tile(b0, b1, n, flags.row_len, flags.block_size, state.bits, p.device)
    nb, block = index.shape
    stored = _take(state.codes, byte).to(torch.uint8)
    codes = unpack_codes(stored.reshape(-1), nb * block, state.bits).view(nb, block).to(torch.int64)
    absmax = state.absmax[b0:b1]
    m = state.qmap[codes] * absmax[:, None]
    p_old = _take(p, index).float()
    p_new, m_new, d = momentum_math(p_old, _take(g, index).float(), m, h, flags.maximize, flags.update)
    m_new = torch.where(index >= 0, m_new, 0.0)
    new_codes, new_absmax = quantize_rows(m_new, state.thresholds)
    if flags.seed is not None:
        u = uniforms(index.clamp(min=0), index.numel(), flags.seed, p.device)[0].view(nb, block)
        new_codes = stochastic_codes(m_new, new_absmax, new_codes, state.encode, u)
    new_codes = torch.where(index >= 0, new_codes, 0).to(torch.uint8)
    packed = torch.empty(nb * block * state.bits // 8, dtype=torch.uint8, device=p.device)
    pack_codes(new_codes.reshape(-1), packed, state.bits)
    _put(state.codes, byte, packed.view(nb, -1))
    state.absmax[b0:b1] = new_absmax
    if p_new is not None:
        _put(p, index, p_new)
    if out is not None:
        _put(out, index, d)


def momentum_step(p, g, state: StepState, h, out, flags: MomentumFlags) -> None:
    """The one-state step (``contract.MOMENTUM_FIELDS``) in place: p (unless UPDATE_NONE), the state's codes
    and scales, and ``out`` = d where given; in chunks of whole blocks."""
    h = on_device(h, p.device)
    blocks = layout_blocks(p.numel(), flags.row_len, flags.block_size)
    step = max(1, STEP_CHUNK // flags.block_size)
    with torch.no_grad():
        for b0 in range(0, blocks, step):
            _momentum_span(p, g, state, h, out, flags, b0, min(blocks, b0 + step))


def momentum_step_group(group: MomentumGroup) -> None:
    """The group's members stepped one after another: what every backend's grouped step must equal."""
    for call in momentum_steps(group):
        momentum_step(*call)
