"""How long DCP metadata checks take on small crafted inputs that used to cost quadratic time (issue #27,
item 4): one tensor as A row strips plus A column strips (2A chunks that form no grid), and P parameters
whose groups are found among G ``param_groups.N.params`` lists of N names.

    python tools/bench/dcp_checks.py [--strips 1000,4000,20000] [--groups 2000 --names 1000]

Prints the median of three runs per size. The pairwise sweep these replace took 6.4 s at A=1000, 41.6 s at
4000 and over 60 s at 20,000; the per-parameter group search over 60 s at 2,000 x 2,000 x 1,000.
"""

from __future__ import annotations

import argparse
import statistics
import time


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--strips", default="1000,4000,20000", help="values of A, comma-separated")
    ap.add_argument("--groups", type=int, default=2000)
    ap.add_argument("--names", type=int, default=1000)
    return ap


if __name__ == "__main__":
    build_parser().parse_args()  # --help and usage errors answer here, before torch and ckptq load

from ckptq.dcp import boxes, folder  # noqa: E402


def _strips(a: int) -> list[tuple]:
    rows = [((i, 0), (1, a)) for i in range(a)]
    cols = [((0, a + j), (a, 1)) for j in range(a)]
    return rows + cols


def _median_seconds(fn, runs: int = 3) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    args = build_parser().parse_args()
    print("| check | size | median s |\n|---|---:|---:|")
    for a in (int(x) for x in args.strips.split(",")):
        chunks = _strips(a)
        assert boxes.overlapping(chunks) is None
        print(f"| chunks overlap (no grid) | {2 * a:,} chunks | {_median_seconds(lambda: boxes.overlapping(chunks)):.3f} |")
    g, n = args.groups, args.names
    scalars = {f"optimizer.param_groups.{i}.params": [f"p{i * n + k}" for k in range(n)] for i in range(g)}
    scalars |= {f"optimizer.param_groups.{i}.eps": 1e-8 for i in range(g)}

    def lookups():
        groups = folder._group_of(scalars)
        for pid in range(0, g * n, n // 2 or 1):  # two parameters per group, as moment pairs would ask
            folder._group_value(scalars, groups, "optimizer", f"p{pid}", "eps", None)
    print(f"| param groups of {g:,} pairs | {g:,} lists x {n:,} names | {_median_seconds(lookups):.3f} |")


if __name__ == "__main__":
    main()
