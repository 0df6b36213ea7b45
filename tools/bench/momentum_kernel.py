"""A quick speed check of the one-state step (SGD / Lion / Muon with 8- or 4-bit state) on the CPU: the C
kernels (``backend_native.momentum_step``) against the PyTorch reference (``momentum_torch.momentum_step``)
and ``torch.optim.SGD(momentum=0.9, foreach=True)`` with its fp32 buffer, on one parameter of ``--n``
elements (fp32 param and grad). Median wall time (and CPU time of all threads) of ``--rounds`` steps each
(``--reference-rounds`` for the reference, which is slow), after one warm-up step.

    PYTHONPATH=. python tools/bench/momentum_kernel.py [--n 16777216] [--rounds 10] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1 << 24)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (the C pool follows them)")
    parser.add_argument("--reference-rounds", type=int, default=3,
                        help="rounds of the PyTorch reference (~25 s a step at 16M elements on 2 cores)")
    parser.add_argument("--skip-reference", action="store_true", help="not the (slow) PyTorch reference")
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help and usage errors answer here, before torch and ckptq load

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # python -P leaves the tool's folder off sys.path
import harness  # noqa: E402
import torch  # noqa: E402

from ckptq.codec import codebooks, policy  # noqa: E402
from ckptq.kernels import backend_native, backend_torch, contract, momentum_torch  # noqa: E402
from ckptq.kernels.contract import UPDATE_LINEAR, UPDATE_NONE, UPDATE_SIGN, MomentumFlags, StepState  # noqa: E402

# (l2, keep, take, c_old, c_new, c_grad, decay, neg_lr)
HYPER = {"SGD": (UPDATE_LINEAR, (0.0, 0.9, 1.0, 0.0, 1.0, 0.0, 1.0, -1e-2)),
         "Lion": (UPDATE_SIGN, (0.0, 0.99, 0.01, 0.9, 0.0, 0.1, 1.0 - 1e-4, -1e-4)),
         "Muon (d out)": (UPDATE_NONE, (0.0, 0.95, 0.05, 0.0, 0.95, 0.05, 1.0, 0.0))}


def median_ms(fn, rounds: int) -> tuple[float, float]:
    """Median wall ms and median CPU ms (all threads of the process: less sensitive to other load on a
    shared machine than wall time) of ``rounds`` calls, after a warm-up call."""
    fn()  # warm-up: builds, plans, page faults
    wall, cpu = [], []
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3


def state(n: int, bits: int, block: int, gen) -> StepState:
    qmap = codebooks.dynamic_map(True) if bits == 8 else policy.ratio_policy(bits).qmap()
    thresholds = contract.midpoints(qmap)
    codes = torch.empty(contract.code_bytes(n, bits), dtype=torch.uint8)
    absmax = torch.empty(contract.num_blocks(n, block), dtype=torch.float32)
    backend_torch.quantize(torch.randn(n, generator=gen) * 1e-2, thresholds, block, False, codes, absmax, bits)
    return StepState(codes, absmax, qmap, thresholds, qmap, bits)


def main() -> None:
    args = build_parser().parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n, gen = args.n, torch.Generator().manual_seed(0)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2
    print(f"{n} elements, block {args.block}, median of {args.rounds}; {harness.machine_line()}\n")
    print("| step | wall ms | wall ns / element | CPU ns / element (all threads) |\n|---|--:|--:|--:|")

    def row(label: str, ms: tuple[float, float]) -> None:
        print(f"| {label} | {ms[0]:.1f} | {ms[0] * 1e6 / n:.2f} | {ms[1] * 1e6 / n:.2f} |", flush=True)

    param = torch.nn.Parameter(p.clone())
    param.grad = g.clone()
    sgd = torch.optim.SGD([param], lr=1e-2, momentum=0.9, foreach=True)
    with torch.no_grad():
        row("torch.optim.SGD(momentum=0.9, foreach=True), fp32 buffer", median_ms(sgd.step, args.rounds))
    for name, (update, values) in HYPER.items():
        h = torch.tensor(values, dtype=torch.float32)
        out = torch.empty(n) if update == UPDATE_NONE else None
        for bits, seed in ((8, None), (4, 1234)):
            s = state(n, bits, args.block, gen)
            flags = MomentumFlags(args.block, False, update, seed)
            rounding = "stochastic" if seed is not None else "nearest"
            row(f"{name} {bits}-bit ({rounding}), C kernels",
                median_ms(lambda: backend_native.momentum_step(p, g, s, h, out, flags), args.rounds))
            if not args.skip_reference and name == "SGD":
                row(f"{name} {bits}-bit ({rounding}), PyTorch reference",
                    median_ms(lambda: momentum_torch.momentum_step(p, g, s, h, out, flags), args.reference_rounds))


if __name__ == "__main__":
    main()
