"""Benchmark ckptq's blockwise codec (8-bit, and 4-bit) against bitsandbytes' on the CPU, side by side.

One run, interleaved rounds (ckptq and bitsandbytes alternate on the same tensors, so load from other
processes hits both alike); prints medians and ratios as a markdown table.

    python tools/bench/codec.py --numel 16777216 --rounds 7

Tensors: an Adam first moment (randn * 1e-3; ckptq: signed map) and a second moment spread over six
decades (randn^2 * 10^U(-8, -2); ckptq: sqrt transform + unsigned map, as ``ckptq.codec.qstate`` stores it).
bitsandbytes uses its default dynamic map on both, at the same block size. The ckptq 4-bit column runs the
same operations with ``bits=4`` (16-entry codebooks at block 128: the 4-bit optimizer's layout;
``convert --bits 4`` writes 6- and 2-bit codes); its ratio is against ckptq's own 8-bit figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 24, help="elements per tensor (default 16M)")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds, interleaved (default 7)")
    parser.add_argument("--block-size", type=int, default=None, help="8-bit block size (default: ckptq's)")
    parser.add_argument("--seed", type=int, default=0)
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help and usage errors answer here, before torch and ckptq load

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # python -P leaves the tool's folder off sys.path
import harness  # noqa: E402
import torch  # noqa: E402

from ckptq.codec import codebooks, ops, policy  # noqa: E402


def make_tensors(numel: int, seed: int) -> dict[str, tuple[torch.Tensor, bool, str]]:
    """name -> (fp32 [numel], ckptq signed map?, ckptq transform)."""
    g = torch.Generator().manual_seed(seed)
    first = torch.randn(numel, generator=g) * 1e-3
    decades = torch.empty(numel).uniform_(-8, -2, generator=g)
    second = torch.randn(numel, generator=g) ** 2 * torch.pow(10.0, decades)
    return {"exp_avg": (first, True, "none"), "exp_avg_sq": (second, False, "sqrt")}


def run_round(tensors, block_size: int, times: dict[str, list[float]], buffers: dict) -> None:
    """Time each operation once for ckptq and once for bitsandbytes; which goes first alternates from
    round to round (it matters: a call that follows one that freed 64 MB gets its pages faster).
    Dequantize is timed twice: into a new tensor (both libraries allocate and the kernel faults the
    pages in), and with ckptq writing into a buffer reused across rounds (``out=``; bitsandbytes' CPU
    backend has no ``out=`` kernel, so its column there is again its allocating call)."""
    import bitsandbytes.functional as bnbf

    round_no = buffers["round"] = buffers.get("round", -1) + 1
    for i, (name, (x, signed, transform)) in enumerate(tensors.items()):
        buf = buffers.setdefault(name, torch.zeros(x.numel()))
        qmap = codebooks.dynamic_map(signed)
        cases = {
            "quantize": (lambda: ops.quantize_blockwise(x, qmap, block_size, transform),
                         lambda: bnbf.quantize_blockwise(x, blocksize=block_size)),
        }
        codes, absmax = cases["quantize"][0]()
        bcodes, state = cases["quantize"][1]()
        cases["dequantize, new tensor"] = (
            lambda: ops.dequantize_blockwise(codes, absmax, qmap, block_size, transform),
            lambda: bnbf.dequantize_blockwise(bcodes, state))
        cases["dequantize, ckptq out= reused"] = (
            lambda: ops.dequantize_blockwise(codes, absmax, qmap, block_size, transform, out=buf),
            lambda: bnbf.dequantize_blockwise(bcodes, state))
        four = _four_bit_cases(x, signed, transform, buf)
        for j, (op, (ours, bnb)) in enumerate(cases.items()):
            order = (("ckptq", ours), ("bnb", bnb), ("ckptq4", four[op]))
            for who, fn in order if (i + j + round_no) % 2 else order[::-1]:
                t = harness.timed(fn)
                times.setdefault(f"{op} {name}|{who}", []).append(t)


def _four_bit_cases(x, signed: bool, transform: str, buf) -> dict:
    """The same operations at 4 bits: block 128, 16-entry codebooks."""
    qmap = codebooks.power_map(signed, 1.5 if signed else 3.0, 4)
    codes, absmax = ops.quantize_blockwise(x, qmap, 128, transform, bits=4)
    n = x.numel()
    return {"quantize": lambda: ops.quantize_blockwise(x, qmap, 128, transform, bits=4),
            "dequantize, new tensor": lambda: ops.dequantize_blockwise(codes, absmax, qmap, 128, transform, bits=4,
                                                                       numel=n),
            "dequantize, ckptq out= reused": lambda: ops.dequantize_blockwise(codes, absmax, qmap, 128, transform,
                                                                              out=buf, bits=4, numel=n)}


def table(times: dict[str, list[float]], numel: int) -> str:
    rows = []
    for op in dict.fromkeys(k.split("|")[0] for k in times):
        ours, bnb, four = (numel / statistics.median(times[f"{op}|{who}"]) / 1e6 for who in ("ckptq", "bnb", "ckptq4"))
        rows.append([op, f"{ours:,.0f}", f"{bnb:,.0f}", harness.ratio(ours, bnb), f"{four:,.0f}",
                     harness.ratio(four, ours)])
    return harness.markdown_table(["operation", "ckptq M elem/s", "bitsandbytes M elem/s", "ratio",
                                   "ckptq 4-bit M elem/s", "4-bit / 8-bit"], rows)


def main() -> None:
    args = build_parser().parse_args()
    args.block_size = args.block_size or policy.DEFAULT_BLOCK_SIZE
    import bitsandbytes

    tensors = make_tensors(args.numel, args.seed)
    times: dict[str, list[float]] = {}
    buffers: dict = {}
    run_round(tensors, args.block_size, {}, buffers)  # warm-up: thread pool, lookup tables, allocator
    for _ in range(args.rounds):
        run_round(tensors, args.block_size, times, buffers)
    print(f"{harness.machine_line()}, bitsandbytes {bitsandbytes.__version__}; {args.numel:,} fp32 elements, "
          f"block {args.block_size}, median of {args.rounds} interleaved rounds")
    print(table(times, args.numel))


if __name__ == "__main__":
    main()
