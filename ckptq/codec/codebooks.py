"""Codebooks: 2**bits entries for states of ``bits``-bit codes (256, 64, 16, 4). Each is sorted ascending, lies in [-1, 1]
and contains 0, except the geometric second-moment maps (``geometric_map``).

Files record the codebook values themselves, so a reader never needs these constructors: they only
decide what new files get.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _dynamic_map_cached(signed: bool) -> torch.Tensor:
    # Decade i (i = 0..6) covers [10^(i-7), 10^(i-6)] x (0.1..1] and holds the midpoints of an even
    # linspace(0.1, 1): 2^i of them when signed (mirrored), 2^(i+1) when unsigned; then 0 and 1.
    # Same construction as bitsandbytes' create_dynamic_map (computed in fp32 there, as here).
    values = [0.0, 1.0]
    for i in range(7):
        n = 2**i if signed else 2 ** (i + 1)
        edges = torch.linspace(0.1, 1, n + 1, dtype=torch.float32)
        means = ((edges[:-1] + edges[1:]) / 2.0 * (10 ** (i - 6))).tolist()
        values += means
        if signed:
            values += [-v for v in means]
    assert len(values) == 256
    return torch.tensor(sorted(values), dtype=torch.float32)


def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256-entry dynamic-tree codebook, sorted ascending, fp32 (a fresh copy)."""
    return _dynamic_map_cached(bool(signed)).clone()


@functools.lru_cache(maxsize=None)
def _power_map_cached(signed: bool, exponent: float, bits: int) -> torch.Tensor:
    # Power-law companding: code k stands for (k / K) ** exponent, so relative spacing is
    # exponent / k, fine near the block's absmax and still reaching (1 / K) ** exponent near zero.
    # This is the "x ** (3/4)" nonuniform quantizer of MP3/AAC (ISO/IEC 11172-3, 13818-7) turned
    # around; Gersho & Gray, "Vector Quantization and Signal Compression" (1992), ch. 5 (companding).
    # Computed in fp64, rounded once to fp32. K = 2**(bits-1) - 1 (signed) or 2**bits - 1 (unsigned).
    size = 2**bits
    if signed:
        # K magnitudes on each side reach exactly -1 and +1; the last entry is half the smallest
        # positive magnitude, so the map stays strictly increasing and contains 0.
        k = size // 2 - 1
        mags = (torch.arange(1, k + 1, dtype=torch.float64) / k) ** exponent
        values = torch.cat([-mags.flip(0), torch.zeros(1, dtype=torch.float64), mags[:1] / 2, mags])
    else:
        values = (torch.arange(0, size, dtype=torch.float64) / (size - 1)) ** exponent
    out = values.to(torch.float32)
    assert out.numel() == size and bool((out[1:] > out[:-1]).all())
    return out


def power_map(signed: bool, exponent: float, bits: int = 8) -> torch.Tensor:
    """2**bits-entry power-law codebook, sorted ascending, fp32 (a fresh copy).

    Unsigned: ``(k / K) ** exponent`` for k = 0..K, K = 2**bits - 1. Signed: ``±(k / K) ** exponent``
    for k = 0..K, K = 2**(bits-1) - 1, plus ``(1 / K) ** exponent / 2``. Both contain 0, -1 (signed)
    and 1 exactly. 8 bits: K = 255 / 127; 4 bits: K = 15 / 7.
    """
    if not exponent > 0:
        raise ValueError(f"power_map exponent must be positive, got {exponent}")
    if bits not in (4, 8):
        raise ValueError(f"power_map takes 4 or 8 bits, got {bits}")
    return _power_map_cached(bool(signed), float(exponent), int(bits)).clone()


# The 4-bit ratio codebook: a Lloyd-Max quantizer (Lloyd, "Least squares quantization in PCM", 1982;
# Max, 1960) for y = x / max|x| over blocks of 128 Gaussian values, with -1, 0 and +1 held fixed (the
# block's extreme is exact, and an all-zero block still has the code of 0): 200 Lloyd iterations on
# 40,000 blocks of torch.randn (seed 0), rounded to 4 digits. Seven levels below zero, eight above (16
# in all). On the ratios of real Adam states (tools/bench/fidelity.py) its worst-tensor error was lower than
# power maps' (|k/7|^e, e = 1..2) and than a Lloyd fit to those ratios themselves.
LLOYD_GAUSSIAN_128 = (-1.0, -0.7417, -0.5674, -0.4288, -0.3097, -0.2014, -0.0991, 0.0,
                      0.0867, 0.1752, 0.268, 0.3676, 0.4785, 0.6073, 0.7685, 1.0)


def lloyd_gaussian_map() -> torch.Tensor:
    """The 16-entry 4-bit ratio codebook above, sorted ascending, fp32 (a fresh tensor)."""
    return torch.tensor(LLOYD_GAUSSIAN_128, dtype=torch.float32)


# The 6-bit ratio codebook of the 4-bit budget (64 entries, -1, 0 and +1 held fixed): built as
# LLOYD_GAUSSIAN_128, 100 Lloyd iterations on 20,000 blocks of 128 torch.randn values (seed 0;
# ``lloyd_map(64)`` of the bit-split experiment, docs/design.md "Finished experiments"), rounded to 4 digits. 31 levels below zero, 32 above.
LLOYD_GAUSSIAN_128_6BIT = (
    -1.0, -0.957, -0.9166, -0.8776, -0.8412, -0.806, -0.7725, -0.7396, -0.708, -0.6766, -0.6454, -0.6146,
    -0.5837, -0.5534, -0.5232, -0.4925, -0.4621, -0.4319, -0.4013, -0.3709, -0.3406, -0.31, -0.2795, -0.2489,
    -0.2182, -0.1873, -0.1563, -0.1252, -0.0939, -0.0626, -0.0313, 0.0, 0.0283, 0.0566, 0.0847, 0.1127, 0.141,
    0.1694, 0.1978, 0.2266, 0.2557, 0.285, 0.3144, 0.3441, 0.3739, 0.4037, 0.4333, 0.463, 0.493, 0.5232,
    0.5535, 0.584, 0.6146, 0.6457, 0.6768, 0.7083, 0.7403, 0.7731, 0.8066, 0.8413, 0.8773, 0.9152, 0.9557, 1.0)


def lloyd_gaussian_map_6bit() -> torch.Tensor:
    """The 64-entry 6-bit ratio codebook above, sorted ascending, fp32 (a fresh tensor)."""
    return torch.tensor(LLOYD_GAUSSIAN_128_6BIT, dtype=torch.float32)


def geometric_map(bits: int = 2, base: float = 3.0) -> torch.Tensor:
    """``base ** (k - K)`` for k = 0..K, K = 2**bits - 1, fp32, ascending, ending at 1: second-moment
    codebooks with the same relative gap everywhere. 2 bits, base 3: a converted file's sqrt(v) / absmax
    on 1/27, 1/9, 1/3, 1; 4 bits, base 1.3: the 4-bit optimizer's, from 1.3**-15 ~ 0.02. No 0 on purpose:
    a value below the lowest level is rounded up to it, never down to a 0 that would lose the element's
    scale (the zero-point problem of Li et al., NeurIPS 2023), and a 2-bit code keeps all 4 levels for
    the spread of a block."""
    k = torch.arange(2**bits, dtype=torch.float64)
    return torch.pow(float(base), k - (2**bits - 1)).to(torch.float32)
