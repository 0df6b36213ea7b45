"""The Triton building blocks every kernel of ``backend_triton`` and ``triton_step`` is made of: a tile of
``ROWS`` quantization blocks of the row layout (``contract``, "Rows"), its codes read and written, its
values encoded (to nearest or stochastically) and decoded.

A tile is ``[ROWS, BLOCK]``: ``ROWS`` consecutive blocks of one parameter (block b is the b-th scale of
its absmax, row-major), one block per tile row, lane c of it the block's c-th element. Block b lies in
row r = b // blocks_per_row at in-row element j * BLOCK (j = b mod blocks_per_row), holds
min(BLOCK, row_len - j * BLOCK) elements (the last of a row may be short), and its codes start at byte
r * row_bytes + j * BLOCK * BITS / 8 (BLOCK is a multiple of 4, so every block starts on a byte). The
flat layout is one row of n elements. All offsets are int64.

Encoding: absmax per block (NaN if the block holds one, as torch's amax), then a branch-free binary search
over the 2**BITS - 1 codebook midpoints, as in bitsandbytes' ``kQuantizeBlockwise`` (csrc/kernels.cu), with
the midpoints stored in the breadth-first order of their search tree (``search_tree``) so that each level's
probes fall on neighbouring entries (Khuong & Morin, "Array layouts for comparison-based searching", 2017).
Exactness on CUDA needs the IEEE-rounded ``tl.math.div_rn`` / ``sqrt_rn`` (Triton's ``/`` and ``tl.sqrt``
on fp32 are approximate there), and the step is launched with ``enable_fp_fusion=False``, so no mul+add
becomes an FMA the reference does not do. A code is read from its bit offset in the row's stream (two
bytes where a 6-bit code straddles them), and written by reshaping the tile's codes into whole-byte
groups (pairs of 4-bit codes, fours of 2- or 6-bit codes) summed into one word per group, stored byte by
byte. bf16 results are rounded to nearest-even with integer arithmetic (what CUDA's cvt.rn does; Triton's
interpreter would truncate), so the interpreter checks the very bits a GPU writes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def geometry(first, count, row_len, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    # The tile of blocks first .. first + count - 1 (count <= ROWS) of a parameter in rows of row_len.
    # Returns b [ROWS] block (= scale) indices, bmask [ROWS] the blocks that exist, r [ROWS] their rows,
    # col0 [ROWS] their first element's index in the row, offs [ROWS, BLOCK] the elements' indices in the
    # parameter, mask [ROWS, BLOCK] the elements that exist. All int64. Where the compiler knows row_len to
    # be a multiple of 16 (a specialized kernel argument, or tl.multiple_of on the load that read it: a
    # hint on a jit function's argument is lost) it knows runs of 16 lanes to be all in or all out, and
    # vectorizes the loads.
    row_len = row_len.to(tl.int64)
    b = first.to(tl.int64) + tl.arange(0, ROWS)
    bmask = tl.arange(0, ROWS) < count
    per_row = (row_len + BLOCK - 1) // BLOCK
    r = b // per_row
    col0 = (b - r * per_row) * BLOCK
    e = col0[:, None] + tl.arange(0, BLOCK)[None, :]  # in-row element index
    mask = (e < row_len) & bmask[:, None]
    return b, bmask, r, col0, r[:, None] * row_len + e, mask


@triton.jit
def _code_base(r, col0, row_len, BITS: tl.constexpr, ALIGNED: tl.constexpr):
    # [ROWS] int64: the byte of each block's first code (rows of code_bytes(row_len, BITS) bytes). ALIGNED:
    # row_len is a multiple of 16, and the row's bytes are written so that the compiler sees a multiple too
    if ALIGNED:
        return r * (row_len.to(tl.int64) * BITS // 8) + col0 * BITS // 8
    return r * ((row_len.to(tl.int64) * BITS + 7) // 8) + col0 * BITS // 8


@triton.jit
def encode(x, mask, tree_ptr, BITS: tl.constexpr):
    # x: fp32 [ROWS, BLOCK] (transform applied), mask: the lanes that exist. Returns (codes int32
    # [ROWS, BLOCK], absmax fp32 [ROWS]). code = #{j : t[j] < y} with y = x / absmax, by a branch-free
    # descent of the midpoints' search tree (``search_tree``: t in breadth-first order), BITS levels: going
    # right where "not t >= y" sends NaN to the top code, like torch.searchsorted. The path read as binary
    # is the code. tl.max skips NaNs but torch's amax returns NaN: put it back.
    ax = tl.where(mask, tl.abs(x), 0.0)  # padding is 0, which never wins the absmax
    has_nan = tl.max((ax != ax).to(tl.int32), axis=1) > 0  # [ROWS]
    absmax = tl.where(has_nan, float("nan"), tl.max(ax, axis=1))  # [ROWS]
    safe = tl.where(absmax > 0, absmax, 1.0)  # all-zero (or NaN) block: divide by 1
    y = tl.math.div_rn(x, safe[:, None])
    node = tl.full(y.shape, 1, dtype=tl.int32)  # the root; the children of node k are 2k and 2k + 1
    for level in tl.static_range(BITS):
        t = tl.load(tree_ptr + node)
        node = 2 * node + 1 - (t >= y).to(tl.int32)
    return node - (1 << BITS), absmax


@triton.jit
def mix32(x):
    # contract.mix32 on uint32 lanes (products wrap mod 2**32)
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def stochastic(pos, x, absmax, enc_ptr, u, BITS: tl.constexpr):
    # Stochastic rounding (contract) of x [ROWS, BLOCK] given encode's nearest codes pos and block scales
    # absmax; enc_ptr: the codebook [2**BITS]; u: fp32 [ROWS, BLOCK] uniforms in [0, 1) (``uniform``).
    top = (1 << BITS) - 1
    safe = tl.where(absmax > 0, absmax, 1.0)
    y = tl.math.div_rn(x, safe[:, None])
    lo = tl.maximum(pos - (y < tl.load(enc_ptr + pos)).to(tl.int32), 0)
    q_lo = tl.load(enc_ptr + lo)
    up = u * (tl.load(enc_ptr + tl.minimum(lo + 1, top)) - q_lo) < y - q_lo
    return tl.where(lo >= top, top, lo + up.to(tl.int32))


@triton.jit
def uniform(hashes, SLOT: tl.constexpr):
    # contract.slot_uniforms: slot SLOT's uniforms from the hashes mix32(i mod 2**32 XOR seed) (uint32): the
    # high half for slot 0, the low half for slot 1, the high half of mix32(hash) for slot 2; 16 bits each
    if SLOT == 2:
        hashes = mix32(hashes)
    if SLOT == 1:
        half = hashes & 0xFFFF
    else:
        half = hashes >> 16
    return half.to(tl.float32) * (1.0 / 65536.0)  # a 16-bit integer: exact


@triton.jit
def load_codes(codes_ptr, r, col0, mask, row_len, BLOCK: tl.constexpr, BITS: tl.constexpr, ALIGNED: tl.constexpr):
    # the tile's codes, int32 [ROWS, BLOCK]: lane c of block (r, col0) is bits [c * BITS, (c + 1) * BITS)
    # of the stream that starts at the block's first code byte
    base = _code_base(r, col0, row_len, BITS, ALIGNED)[:, None]
    if BITS == 8:
        return tl.load(codes_ptr + base + tl.arange(0, BLOCK)[None, :], mask=mask, other=0).to(tl.int32)
    bit = tl.arange(0, BLOCK)[None, :] * BITS
    shift = bit % 8
    word = tl.load(codes_ptr + base + bit // 8, mask=mask, other=0).to(tl.int32)
    if BITS == 6:  # codes at bit 4 or 6 of a byte go on into the next one
        word = word | (tl.load(codes_ptr + base + bit // 8 + 1, mask=mask & (shift > 2), other=0).to(tl.int32) << 8)
    return (word >> shift) & ((1 << BITS) - 1)


@triton.jit
def decode(codes_ptr, absmax_ptr, qmap_ptr, b, bmask, r, col0, mask, row_len, BLOCK: tl.constexpr,
           BITS: tl.constexpr, ALIGNED: tl.constexpr):
    # the tile's codes -> qmap[code] * absmax (no transform; two separate roundings); absent lanes 0.
    code = load_codes(codes_ptr, r, col0, mask, row_len, BLOCK, BITS, ALIGNED)
    scale = tl.load(absmax_ptr + b, mask=bmask, other=0.0)
    x = tl.load(qmap_ptr + code) * scale[:, None]
    return tl.where(mask, x, 0.0)


@triton.jit
def store(codes, absmax, codes_ptr, absmax_ptr, b, bmask, r, col0, mask, row_len,
          BLOCK: tl.constexpr, ROWS: tl.constexpr, BITS: tl.constexpr, ALIGNED: tl.constexpr):
    # codes int32 [ROWS, BLOCK] and absmax fp32 [ROWS] of the tile into the row layout: each block's
    # code_bytes(its length, BITS) bytes from its first code byte, the bits after its last code 0.
    base = _code_base(r, col0, row_len, BITS, ALIGNED)[:, None]
    if ALIGNED:  # whole bytes, written so that the compiler sees a multiple of 2 * BITS
        nbytes = ((row_len.to(tl.int64) - col0) * BITS)[:, None] // 8
    else:  # the block's bytes: its elements (at most BLOCK, so int32) times BITS / 8, rounded up
        nbytes = ((tl.minimum(row_len.to(tl.int64) - col0, BLOCK).to(tl.int32) * BITS + 7) // 8)[:, None]
    codes = tl.where(mask, codes, 0)
    if BITS == 8:
        tl.store(codes_ptr + base + tl.arange(0, BLOCK)[None, :], codes.to(tl.uint8), mask=mask)
    elif BITS == 4:  # element pairs (2i, 2i + 1) -> byte i: low, high nibble
        lo, hi = tl.split(tl.reshape(codes, (ROWS, BLOCK // 2, 2)))
        k = tl.arange(0, BLOCK // 2)[None, :]
        tl.store(codes_ptr + base + k, (lo | (hi << 4)).to(tl.uint8), mask=(k < nbytes) & bmask[:, None])
    else:  # 2 or 6 bits: elements 4i .. 4i + 3 -> one word of 1 or 3 bytes (disjoint bits: the sum is an or)
        quads = tl.reshape(codes, (ROWS, BLOCK // 4, 4))
        word = tl.sum(quads << (tl.arange(0, 4) * BITS)[None, None, :], axis=2)  # [ROWS, BLOCK / 4]
        for j in tl.static_range(BITS // 2):  # the group's bytes: 1 (2 bits) or 3 (6 bits)
            k = tl.arange(0, BLOCK // 4)[None, :] * (BITS // 2) + j
            tl.store(codes_ptr + base + k, ((word >> (8 * j)) & 255).to(tl.uint8), mask=(k < nbytes) & bmask[:, None])
    tl.store(absmax_ptr + b, absmax, mask=bmask)


@triton.jit
def cast_to(x, DTYPE: tl.constexpr):
    # fp32 x rounded to DTYPE (nearest-even); bf16 by integer arithmetic, NaN -> 0x7FC0 (as torch's CPU)
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16  # no wrap: the largest non-NaN is 0xFF800000
        bits = tl.where(x != x, 0x7FC0, bits)
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(DTYPE)


_TREE_ORDER: dict = {}  # (bits, device) -> int64 [2**bits]: 0, then the midpoint index of each node


def search_tree(thresholds: torch.Tensor) -> torch.Tensor:
    """fp32 [2**bits]: the 2**bits - 1 ascending midpoints in breadth-first order of their balanced search
    tree (the "Eytzinger" layout), node k at entry k (k >= 1; entry 0 is padding), its children at 2k and
    2k + 1. Level L of the descent then reads the 2**L entries [2**L, 2**(L + 1)), not 2**L entries spread
    over the table: for 8-bit codes a warp's 8 levels touch 1, 1, 1, 1, 1, 1, 2 and 4 cache lines (12 L1
    passes) instead of ~47. Built on the device without host copies."""
    bits = thresholds.numel().bit_length()
    key = (bits, thresholds.device)
    if key not in _TREE_ORDER:  # level L holds midpoints (2j + 1) * 2**(bits - 1 - L) - 1, j < 2**L
        levels = [torch.arange(2 ** (bits - 1 - level) - 1, 2**bits - 1, 2 ** (bits - level), device=thresholds.device)
                  for level in range(bits)]
        _TREE_ORDER[key] = torch.cat([levels[0]] + levels)  # entry 0: any midpoint, never read
    return thresholds[_TREE_ORDER[key]]


TILE_ELEMENTS = 2048  # elements per program: ROWS blocks of BLOCK (docs/design.md, "Finished experiments": the sweep that chose it)
TILE_WARPS = 4  # warps per program of TILE_ELEMENTS (twice as many for the one 4096-element block)


def tile_shape(block_size: int, longest_row: int) -> tuple[int, int, int]:
    """(BLOCK, ROWS, num_warps) of the tiles of parameters whose rows are at most ``longest_row`` long:
    BLOCK is the block size, or, where every row fits in half a block or less, the power of two that holds
    the longest row (the same blocks: one per row; fewer idle lanes); ROWS blocks per program make
    ~TILE_ELEMENTS elements."""
    width = block_size if longest_row >= block_size else max(32, min(block_size, triton.next_power_of_2(longest_row)))
    rows = max(1, TILE_ELEMENTS // width)
    return width, rows, TILE_WARPS * 2 if rows * width > TILE_ELEMENTS else TILE_WARPS


@triton.jit
def sign_of(d):
    # the contract's sign: -1, +0 or 1, NaN for NaN
    s = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
    return tl.where(d != d, d, s)
