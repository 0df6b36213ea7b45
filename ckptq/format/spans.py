"""Byte ranges that must not share bytes: the records of a torch.save archive, the items of a DCP data file."""

from __future__ import annotations


def overlapping_ranges(ranges: list[tuple]) -> tuple | None:
    """Two overlapping (start, length, ...) ranges of nonzero length, if any; O(n log n)."""
    reach = None  # the range reaching furthest so far
    for r in sorted(r for r in ranges if r[1]):
        if reach is not None and r[0] < reach[0] + reach[1]:
            return reach, r
        if reach is None or r[0] + r[1] > reach[0] + reach[1]:
            reach = r
    return None
