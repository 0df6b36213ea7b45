"""What ``--replace`` costs: convert and expand with and without it, each a fresh ``ckptq`` process, rounds
interleaved; medians and the ratio of each ``--replace`` run to the same command without it (the read-back
check: checksums, exact tensors compared, 8-bit states re-quantized; expand: the written file reloaded
and compared with the decoding).

    python tools/bench/replace.py --mparams 16 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mparams", type=float, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help and usage errors answer here, before torch and ckptq load

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # python -P leaves the tool's folder off sys.path
import harness  # noqa: E402
import torch  # noqa: E402


def make_checkpoint(path: str, mparams: float) -> None:
    """An AdamW checkpoint of ``mparams`` million fp32 parameters in 8 tensors (weights + two moments)."""
    g = torch.Generator().manual_seed(0)
    n = int(mparams * 1e6) // 8 // 1024 * 1024
    weights = {f"w{i}": torch.randn(n, generator=g) for i in range(8)}
    state = {i: {"step": torch.tensor(100.0), "exp_avg": torch.randn(n, generator=g) * 1e-3,
                 "exp_avg_sq": torch.rand(n, generator=g) * 1e-6} for i in range(8)}
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "params": list(range(8))}]
    torch.save({"model": weights, "optimizer": {"state": state, "param_groups": groups}}, path)


def timed(*args: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process: user + system; steadier on a shared machine)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "ckptq", *args, "-q"], check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    args = build_parser().parse_args()
    with tempfile.TemporaryDirectory() as d:
        src, work = os.path.join(d, "src.pt"), os.path.join(d, "ckpt.pt")
        make_checkpoint(src, args.mparams)
        q8, back = os.path.join(d, "ckpt.q8.safetensors"), os.path.join(d, "back.pt")
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in ("convert", "convert --replace", "expand", "expand --replace")}
        for r in range(args.rounds):
            for replace in ((False, True) if r % 2 == 0 else (True, False)):  # alternate which goes first
                shutil.copyfile(src, work)
                flag = ["--replace"] if replace else []
                times["convert" + " --replace" * replace].append(timed("convert", work, "--force", *flag))
                times["expand" + " --replace" * replace].append(timed("expand", q8, "-o", back, "--force", *flag))
                for p in (work, q8, back):
                    if os.path.exists(p):
                        os.unlink(p)
        size = os.path.getsize(src) / 1e6
    print(f"{args.mparams:g} M params, fp32 checkpoint {size:,.0f} MB, {args.rounds} rounds (fresh process each); "
          f"{harness.machine_line()}")
    print("| command | wall s | vs without --replace | CPU s | vs without --replace |\n|---|---:|---:|---:|---:|")
    for name, ts in times.items():
        base = times[name.removesuffix(" --replace")]
        wall, cpu = (statistics.median(t[i] for t in ts) for i in (0, 1))
        wall0, cpu0 = (statistics.median(t[i] for t in base) for i in (0, 1))
        print(f"| ckptq {name} | {wall:.2f} | {wall / wall0:.2f}x | {cpu:.2f} | {cpu / cpu0:.2f}x |")


if __name__ == "__main__":
    main()
