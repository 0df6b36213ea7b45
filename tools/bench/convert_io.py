"""Large-checkpoint benchmark: convert/expand wall time and peak anonymous memory vs the I/O floor.

Generates a synthetic fp32 Adam checkpoint (nanoGPT layout; default ~2 GB, largest tensor 64 MB),
then, in one run with interleaved rounds, times in fresh processes:

  floor      torch.load(mmap=True) of it + writing the same tensor bytes raw to a file (+ fsync)
  convert    ckptq convert (no compression)
  convert+z  ckptq convert --compress
  convert4   ckptq convert --bits 4
  expand     ckptq expand of the converted file

Peak RssAnon (anonymous memory: what the process itself needs; file-backed pages of a memory-mapped
input are page cache) is sampled from /proc every 5 ms, interpreter and torch included.

    python tools/bench/convert_io.py --size-gb 2 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/ckptq_bench")
    ap.add_argument("--no-compress", action="store_true", help="skip the convert --compress variant")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where convert quantizes (cuda: Triton kernels on the GPU, overlapped with the I/O)")
    return ap


if __name__ == "__main__":
    build_parser().parse_args()  # --help and usage errors answer here, before torch and ckptq load

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # python -P leaves the tool's folder off sys.path
import harness  # noqa: E402
import torch  # noqa: E402

FLOOR = r"""
import os, sys, torch
src, dst = sys.argv[1], sys.argv[2]
ck = torch.load(src, mmap=True, weights_only=True)
def tensors(o):
    if isinstance(o, torch.Tensor): yield o
    elif isinstance(o, dict):
        for v in o.values(): yield from tensors(v)
    elif isinstance(o, (list, tuple)):
        for v in o: yield from tensors(v)
with open(dst, "wb") as f:
    for t in tensors(ck):
        f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    f.flush(); os.fsync(f.fileno())
"""


def make_checkpoint(path: str, size_gb: float, largest_mb: int = 64) -> None:
    """fp32 weights + exp_avg + exp_avg_sq (12 B/param); big matrices of `largest_mb`, plus small ones."""
    g = torch.Generator().manual_seed(0)
    big = largest_mb * 2**20 // 4
    n_big = max(1, int(size_gb * 1e9 / 12 / big))
    shapes = [(big // 4096, 4096)] * n_big + [(4096,)] * 8
    model, state = {}, {}
    for i, shape in enumerate(shapes):
        w = torch.randn(shape, generator=g) * 0.02
        model[f"layer{i}.weight"] = w
        m = torch.randn(shape, generator=g) * 1e-3
        v = (torch.randn(shape, generator=g) * 1e-3) ** 2 * torch.rand(shape, generator=g) ** 4
        state[i] = {"step": torch.tensor(1000.0), "exp_avg": m, "exp_avg_sq": v}
    groups = [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
               "params": list(range(len(shapes)))}]
    torch.save({"model": model, "optimizer": {"state": state, "param_groups": groups}, "iter_num": 1000}, path)


def run_measured(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RssAnon bytes of a subprocess."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0

    def sample():
        nonlocal peak
        path = f"/proc/{proc.pid}/status"
        while proc.poll() is None:
            try:
                for line in open(path):
                    if line.startswith("RssAnon:"):
                        peak = max(peak, int(line.split()[1]) * 1024)
            except OSError:
                break
            time.sleep(0.005)

    th = threading.Thread(target=sample)
    th.start()
    _, err = proc.communicate()
    th.join()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {err.decode()[-500:]}")
    return time.perf_counter() - t0, peak


def main() -> None:
    args = build_parser().parse_args()
    os.makedirs(args.dir, exist_ok=True)
    src = os.path.join(args.dir, f"ckpt_{args.size_gb:g}gb.pt")
    if not os.path.exists(src):
        print(f"generating {src} ...", file=sys.stderr)
        make_checkpoint(src, args.size_gb)
    size = os.path.getsize(src)
    out = lambda name: os.path.join(args.dir, name)  # noqa: E731
    py = sys.executable
    variants = {
        "floor (mmap load + raw write)": [py, "-c", FLOOR, src, out("floor.bin")],
        "convert": [py, "-m", "ckptq", "convert", src, "-o", out("c.safetensors"), "-f", "-q", "--device", args.device],
        "convert --compress": [py, "-m", "ckptq", "convert", src, "-o", out("cz.safetensors"), "-f", "-q", "--compress",
                               "--device", args.device],
        "convert --bits 4": [py, "-m", "ckptq", "convert", src, "-o", out("c4.safetensors"), "-f", "-q", "--bits", "4",
                             "--device", args.device],
        "expand": [py, "-m", "ckptq", "expand", out("c.safetensors"), "-o", out("e.pt"), "-f", "-q"],
    }
    if args.no_compress:
        del variants["convert --compress"]
    subprocess.run(variants["convert"], check=True)  # warm the page cache and make expand's input
    results = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, cmd in variants.items():
            results[name].append(run_measured(cmd))
    floor = statistics.median(t for t, _ in results["floor (mmap load + raw write)"])
    print(f"checkpoint: {size / 1e9:.2f} GB, {args.rounds} interleaved rounds (medians); {harness.machine_line()}\n")
    print("| step | wall s | GB/s of input | vs floor | peak RssAnon MB | output MB |")
    print("|---|---|---|---|---|---|")
    outputs = {"convert": "c.safetensors", "convert --compress": "cz.safetensors", "expand": "e.pt",
               "convert --bits 4": "c4.safetensors",
               "floor (mmap load + raw write)": "floor.bin"}
    for name, rows in results.items():
        t = statistics.median(r[0] for r in rows)
        rss = max(r[1] for r in rows)
        osize = os.path.getsize(out(outputs[name])) / 1e6
        print(f"| {name} | {t:.2f} | {size / 1e9 / t:.2f} | {t / floor:.2f}x | {rss / 1e6:.0f} | {osize:,.0f} |")


if __name__ == "__main__":
    main()
