"""``ckptq convert`` of a DCP folder with 1 and N processes: wall time, peak memory of the largest
process, output size, against copying the folder (the I/O floor), interleaved rounds in one run.

    python tools/bench/dcp_convert.py --size-gb 2 --procs 1,2 --rounds 3

The folder is a ``dcp.save`` of ``{"model", "optimizer"}`` holding fp32 weights and torch AdamW moments of
``--tensor-mb``-sized parameters (12 bytes per parameter in all), written once. Each step runs in fresh
processes (``ckptq convert`` / ``torchrun -m ckptq convert``); peak memory is the largest RssAnon among
them, sampled every 20 ms (the interpreter and torch are ~150 MB of it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--tensor-mb", type=int, default=64)
    ap.add_argument("--procs", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/ckptq_bench_dcp")
    ap.add_argument("--baseline", help="another ckptq checkout (e.g. a git worktree of an older commit) whose "
                                       "convert runs interleaved with this one's: before/after in one run (through "
                                       "PYTHONPATH; ckptq.kernels still comes from the installed package)")
    return ap


if __name__ == "__main__":
    build_parser().parse_args()  # --help and usage errors answer here, before torch and ckptq load

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # python -P leaves the tool's folder off sys.path
import harness  # noqa: E402
import torch  # noqa: E402


def make_folder(path: str, size_gb: float, tensor_mb: int) -> None:
    import torch.distributed.checkpoint as dcp

    numel = tensor_mb * 2**20 // 4
    n = max(1, int(size_gb * 2**30 / (12 * numel)))
    rows = numel // 1024
    g = torch.Generator().manual_seed(0)
    model = {f"layer{i}.weight": torch.randn(rows, 1024, generator=g) for i in range(n)}
    state = {k: {"step": torch.tensor(100.0), "exp_avg": torch.randn(rows, 1024, generator=g) * 1e-3,
                 "exp_avg_sq": torch.rand(rows, 1024, generator=g) * 1e-6} for k in model}
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "params": list(model)}]
    dcp.save({"model": model, "optimizer": {"state": state, "param_groups": groups}}, checkpoint_id=path,
             no_dist=True)


def _children() -> dict[int, int]:
    """pid -> parent pid of every process."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    out[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return out


def _rss_anon(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:")), 0)
    except OSError:
        return 0


def timed(cmd: list[str], pythonpath: str | None = None) -> tuple[float, float]:
    """Wall seconds and the peak RssAnon (MB) of the largest process in the command's tree (torchrun's
    workers included; anonymous memory only: pages of files read through mmap are the page cache's)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **({"PYTHONPATH": pythonpath} if pythonpath else {})})
    peak = 0

    def sample() -> None:
        nonlocal peak
        while proc.poll() is None:
            parents, tree = _children(), {proc.pid}
            for _ in range(3):  # torchrun -> agent -> workers
                tree |= {pid for pid, ppid in parents.items() if ppid in tree}
            peak = max([peak] + [_rss_anon(pid) for pid in tree])
            time.sleep(0.02)

    th = threading.Thread(target=sample)
    th.start()
    _, err = proc.communicate()
    th.join()
    if proc.returncode:
        sys.exit(err.decode()[-2000:])
    return time.perf_counter() - t0, peak / 2**20


def main() -> None:
    a = build_parser().parse_args()
    src = os.path.join(a.dir, "src")
    if not os.path.isdir(src):
        os.makedirs(a.dir, exist_ok=True)
        make_folder(src, a.size_gb, a.tensor_mb)
    out = os.path.join(a.dir, "out")
    steps = {"copy (I/O floor)": ["cp", "-r", src, out]}
    for n in map(int, a.procs.split(",")):
        ckptq = [sys.executable, "-m", "ckptq", "convert", src, "-o", out, "-f"]
        steps[f"convert, {n} process{'es' if n > 1 else ''}"] = ckptq if n == 1 else \
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *ckptq[1:]]
    paths = {name: None for name in steps}
    if a.baseline:
        for name in [n for n in steps if n.startswith("convert")]:
            steps[f"baseline {name}"], paths[f"baseline {name}"] = steps[name], os.path.abspath(a.baseline)
    times: dict = {k: [] for k in steps}
    peaks: dict = {}
    sizes: dict = {}
    for _ in range(a.rounds):
        for name, cmd in steps.items():  # interleaved: load from elsewhere hits every step alike
            shutil.rmtree(out, ignore_errors=True)
            seconds, peak = timed(cmd, paths[name])
            times[name].append(seconds)
            peaks[name] = peak
            sizes[name] = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    floor = statistics.median(times["copy (I/O floor)"])
    src_bytes = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src))
    print(f"DCP folder of {src_bytes / 2**30:.2f} GB (fp32 weights + AdamW moments), {a.rounds} rounds, medians; "
          f"{harness.machine_line()}\n")
    print("| step | wall s | vs floor | output | peak RssAnon of the largest process |")
    print("|---|---:|---:|---:|---:|")
    for name in steps:
        t = statistics.median(times[name])
        print(f"| {name} | {t:.2f} | {t / floor:.2f}x | {sizes[name] / 2**20:,.0f} MB | {peaks[name]:,.0f} MB |")


if __name__ == "__main__":
    main()
