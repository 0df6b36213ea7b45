"""Whether boxes overlap: a DCP tensor's chunks (offsets, sizes); the byte ranges its items take in a
data file are checked by ``ckptq.format.spans``. Each check takes O(n log n) in the number of boxes, so that a small crafted ``.metadata``
with thousands of chunks is answered in moments (a pairwise comparison took minutes).

- Chunks that form a grid (every real sharding does: FSDP, TP, HSDP, uneven shards) are checked by
  their cells: each chunk must be one cell of the grid its own offsets cut, and no cell taken twice.
- Otherwise, in one or two dimensions, a sweep: along dimension 0 the chunks still open all contain the
  sweep position, so theirs extents in dimension 1 must be disjoint, and a sorted list of them finds an
  overlap with the next chunk's by bisection.
- Three or more dimensions that do not form a grid (no sharding writes them) are compared pairwise
  among the open chunks, up to ``MAX_PAIRWISE`` comparisons; beyond that ckptq refuses the folder.
"""

from __future__ import annotations

import bisect
import heapq

MAX_PAIRWISE = 2_000_000  # comparisons of 3-D+ boxes that do not form a grid, per tensor


class TooIrregular(Exception):
    """The boxes are too many and too irregular to check within ``MAX_PAIRWISE`` comparisons."""


def overlapping(boxes: list[tuple]) -> tuple | None:
    """The offsets of two overlapping boxes ((offsets, sizes), none empty, all of one dimensionality), if any."""
    if len(boxes) < 2 or not boxes[0][0]:
        return None
    if _one_cell_each(boxes):
        return None
    if len(boxes[0][0]) <= 2:
        return _sweep_2d(boxes)
    return _sweep_pairwise(boxes)


def _one_cell_each(boxes: list[tuple]) -> bool:
    """Whether each box is exactly one cell of the grid cut by all boxes' starts and ends, no cell twice.
    Such boxes are disjoint (False says nothing: the boxes may still be disjoint, or not)."""
    dims = len(boxes[0][0])
    cuts = [sorted({o[d] for o, _ in boxes} | {o[d] + s[d] for o, s in boxes}) for d in range(dims)]
    where = [{c: i for i, c in enumerate(cs)} for cs in cuts]
    cells = set()
    for o, s in boxes:
        cell = tuple(where[d][o[d]] for d in range(dims))
        if any(where[d][o[d] + s[d]] != cell[d] + 1 for d in range(dims)) or cell in cells:
            return False
        cells.add(cell)
    return True


def _sweep_2d(boxes: list[tuple]) -> tuple | None:
    """Sweep along dimension 0; the open boxes' extents in dimension 1 (all of it for 1-D boxes) are
    disjoint, kept sorted by start."""
    flat = len(boxes[0][0]) == 1
    open_starts: list[int] = []  # dimension-1 starts of the open boxes, sorted
    open_by_start: dict[int, tuple] = {}  # dimension-1 start -> (end, offsets)
    ends: list[tuple] = []  # heap of (dimension-0 end, dimension-1 start)
    for offsets, sizes in sorted(boxes):
        while ends and ends[0][0] <= offsets[0]:
            _, start = heapq.heappop(ends)
            del open_starts[bisect.bisect_left(open_starts, start)]
            del open_by_start[start]
        lo, hi = (0, 1) if flat else (offsets[1], offsets[1] + sizes[1])
        i = bisect.bisect_right(open_starts, lo)
        for j in (i - 1, i):  # the open extent starting at or before lo, and the next one
            if 0 <= j < len(open_starts):
                start = open_starts[j]
                end, other = open_by_start[start]
                if start < hi and lo < end:
                    return other, offsets
        open_starts.insert(i, lo)
        open_by_start[lo] = (hi, offsets)
        heapq.heappush(ends, (offsets[0] + sizes[0], lo))
    return None


def _sweep_pairwise(boxes: list[tuple]) -> tuple | None:
    """Sweep along the dimension with the most distinct offsets, each box compared with those still open."""
    dim = max(range(len(boxes[0][0])), key=lambda d: len({o[d] for o, _ in boxes}))
    open_: list[tuple] = []
    budget = MAX_PAIRWISE
    for offsets, sizes in sorted(boxes, key=lambda b: b[0][dim]):
        open_ = [b for b in open_ if b[0][dim] + b[1][dim] > offsets[dim]]
        budget -= len(open_)
        if budget < 0:
            raise TooIrregular()
        for o, s in open_:
            if all(a < b + t and b < a + u for a, u, b, t in zip(offsets, sizes, o, s)):
                return o, offsets
        open_.append((offsets, sizes))
    return None
