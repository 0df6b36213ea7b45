"""The contract written out plainly (``contract``): rounding to a codebook, and the bit-stream layout of
codes, flat and in rows. The PyTorch backend and the row-layout reference build on these.
"""

from __future__ import annotations

import torch

from .contract import code_bytes, group_shape, num_blocks


def reference_codes(x: torch.Tensor, thresholds: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rounding contract written out plainly. x: fp32 [n] (transform already applied).
    Returns codes uint8 [n] and absmax fp32 [ceil(n / block_size)]."""
    n = x.numel()
    nb = num_blocks(n, block_size)
    blocks = torch.nn.functional.pad(x, (0, nb * block_size - n)).view(nb, block_size)  # zeros never win absmax
    absmax = blocks.abs().amax(dim=1)  # [nb]
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    y = blocks / safe[:, None]  # IEEE division, as the kernels do
    codes = torch.searchsorted(thresholds, y, right=False, out_int32=True)  # #{t < y}
    return codes.view(-1)[:n].to(torch.uint8), absmax


def pack_codes(codes: torch.Tensor, out: torch.Tensor, bits: int) -> None:
    """out uint8 [code_bytes(n, bits)] = codes uint8 [n] (each below 2**bits) packed as ``contract`` lays
    them out: each group of whole-byte codes (``group_shape``) as one little-endian word."""
    if bits == 8:
        out.copy_(codes)
        return
    g, w = group_shape(bits)
    c = torch.nn.functional.pad(codes, (0, -codes.numel() % g)).view(-1, g).to(torch.int32)
    word = c[:, 0].clone()
    for k in range(1, g):
        word |= c[:, k] << (bits * k)
    packed = torch.stack([(word >> (8 * j)) & 255 for j in range(w)], dim=1).view(-1)
    out.copy_(packed[: out.numel()])  # the bytes past code_bytes(n) hold only zero padding


def unpack_codes(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """The n codes (uint8 [n]) that ``pack_codes`` packed into ``packed``."""
    if bits == 8:
        return packed[:n]
    g, w = group_shape(bits)
    b = torch.nn.functional.pad(packed, (0, -packed.numel() % w)).view(-1, w).to(torch.int32)
    word = b[:, 0].clone()
    for j in range(1, w):
        word |= b[:, j] << (8 * j)
    codes = torch.stack([(word >> (bits * k)) & (2**bits - 1) for k in range(g)], dim=1).view(-1)
    return codes[:n].to(torch.uint8)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes uint8 [rows, row_len] (each below 2**bits) -> uint8 [rows, code_bytes(row_len, bits)], each row
    packed on its own as ``backend_torch.pack_codes`` packs a flat stream (zero bits after its last code)."""
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
    rows = packed.shape[0]
    if bits == 8:
        return packed
    g, w = group_shape(bits)
    padded_len = row_len + (-row_len % g)
    wide = torch.nn.functional.pad(packed, (0, padded_len * bits // 8 - packed.shape[1]))
    return unpack_codes(wide.reshape(-1), rows * padded_len, bits).view(rows, padded_len)[:, :row_len]
