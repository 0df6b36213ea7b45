"""256-entry codebooks for 8-bit states. Each is sorted ascending, lies in [-1, 1] and contains 0.

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
