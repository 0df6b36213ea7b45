"""Lookup tables of the CPU backends: rounding to a codebook in one lookup, decoding two codes in one.

Rounding contract (every backend): with ``t`` the ascending fp32 midpoints of the codebook (255 for
8-bit codes, 15 for 4-bit ones), ``code = #{j : t[j] < y}`` where ``y = x / absmax`` is an IEEE fp32
division; a NaN ``y`` gets the top code, len(t) (255 or 15).

Code table. Every fp32 y falls in one of 2^16 buckets: the floats that share y's top 16 bits (sign,
exponent, 7 mantissa bits), a closed interval [lo_b, hi_b]. With base_b = #{t < lo_b}, and thresholds t
sorted, #{t < y} = base_b + #{j : lo_b <= t[j] < y}. When at most one threshold lies in [lo_b, hi_b] it
can only be t[base_b] (the first one >= lo_b; if that lies above hi_b it lies above y too), so
code = base_b + (t[base_b] < y): one table lookup and one exact fp32 compare, the answer of searchsorted
for every y. Codebooks with two thresholds in one bucket get no table (the PyTorch backend then uses
searchsorted, and the C kernels are not used). NaN buckets map to len(t), as searchsorted does.
tests/codec/test_codec.py checks both ends of every bucket and every threshold +-1 ulp.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

SIGN_FLIP = 1 << 15  # (int32 bits >> 16) is in [-2^15, 2^15); adding this makes it a table index


class CodeTable(NamedTuple):
    base: torch.Tensor  # uint8 [65536], indexed by (bits of y >> 16) + 2^15
    thr: torch.Tensor  # fp32 [65536]: t[base], +inf when base is len(t)


def bucket_bounds() -> tuple[torch.Tensor, torch.Tensor]:
    """lo, hi: fp32 [65536], the smallest and largest value of each bucket, in table order."""
    top = torch.arange(-SIGN_FLIP, SIGN_FLIP, dtype=torch.int64)  # signed top 16 bits
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


def _key(t: torch.Tensor) -> bytes:
    return t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()


@functools.lru_cache(maxsize=16)
def _code_table_cpu(threshold_bytes: bytes) -> CodeTable | None:
    t = torch.frombuffer(bytearray(threshold_bytes), dtype=torch.float32)  # [255] or [15]
    lo, hi = bucket_bounds()
    base = torch.searchsorted(t, lo)  # #{t < lo}; NaN -> len(t)
    inside = torch.searchsorted(t, hi, right=True) - base  # #{t in [lo, hi]}; 0 for NaN buckets
    if bool((inside > 1).any()):
        return None
    t_ext = torch.cat([t, torch.full((1,), float("inf"))])  # t_ext[len(t)] = +inf never compares below y
    return CodeTable(base.to(torch.uint8), t_ext[base])


def code_table(thresholds: torch.Tensor) -> CodeTable | None:
    """The table for 255 (or 15) ascending thresholds, on their device; None when a bucket holds two."""
    table = _code_table_cpu(_key(thresholds))
    if table is None or thresholds.device.type == "cpu":
        return table
    return CodeTable(table.base.to(thresholds.device), table.thr.to(thresholds.device))


@functools.lru_cache(maxsize=16)
def _native_code_table(threshold_bytes: bytes) -> torch.Tensor | None:
    table = _code_table_cpu(threshold_bytes)
    t = torch.frombuffer(bytearray(threshold_bytes), dtype=torch.float32)
    if table is None or bool(((t == 0) & torch.signbit(t)).any()):
        return None  # two thresholds in a bucket, or a -0.0 threshold: the C kernels cannot serve it
    bucket = torch.arange(-SIGN_FLIP, SIGN_FLIP, dtype=torch.int32)  # signed top 16 bits, table order
    thr_bits = table.thr.view(torch.int32)
    # the threshold lies in the bucket (by bits: -0.0 vs +0.0 apart); the +inf that pads t is none, so the
    # +inf bucket's NaN patterns cannot carry past the top code
    inside = ((thr_bits >> 16) == bucket) & (table.base.to(torch.int64) < t.numel())
    rank = torch.where(thr_bits < 0, thr_bits ^ 0xFFFF, thr_bits) & 0xFFFF
    limit = torch.where(inside, rank + 1, torch.full_like(rank, 1 << 16))  # 1 .. 65536 (none inside)
    return (table.base.to(torch.int32) << 17) | ((1 << 17) - limit)


def native_code_table(thresholds: torch.Tensor) -> torch.Tensor | None:
    """int32 [65536] code table of ``cpu_kernels.c`` (``base << 17 | (2**17 - limit)``, see its header:
    ``(entry + rank) >> 17`` is the code) for ascending fp32 thresholds, or None where the C kernels
    cannot serve the codebook."""
    return _native_code_table(_key(thresholds))


@functools.lru_cache(maxsize=16)
def _pair_table(qmap_bytes: bytes) -> torch.Tensor:
    q = torch.frombuffer(bytearray(qmap_bytes), dtype=torch.float32)
    pairs = torch.stack([q.repeat(256), q.repeat_interleave(256)], dim=1)  # [65536, 2]: (low, high)
    return pairs.contiguous().view(torch.float64).reshape(-1)


def pair_table(qmap: torch.Tensor) -> torch.Tensor:
    """[65536] float64 whose 8 bytes are the fp32 pair (qmap[i & 255], qmap[i >> 8]): one gather
    decodes two codes (little-endian: the first code is the low byte of a uint16)."""
    return _pair_table(_key(qmap))


@functools.lru_cache(maxsize=16)
def _nibble_pair_table(qmap_bytes: bytes) -> torch.Tensor:
    q = torch.frombuffer(bytearray(qmap_bytes), dtype=torch.float32)  # [16]
    byte = torch.arange(256)
    pairs = torch.stack([q[byte & 15], q[byte >> 4]], dim=1)  # [256, 2]: (low nibble, high nibble)
    return pairs.contiguous().view(torch.float64).reshape(-1)


def nibble_pair_table(qmap: torch.Tensor) -> torch.Tensor:
    """[256] float64 whose 8 bytes are the fp32 pair (qmap[b & 15], qmap[b >> 4]) for a 16-entry codebook:
    one gather decodes the two 4-bit codes of byte b, in element order."""
    return _nibble_pair_table(_key(qmap)).to(qmap.device)
