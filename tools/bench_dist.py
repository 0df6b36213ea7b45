"""Optimizer state per rank and DCP folder size under FSDP2: torch AdamW, ckptq AdamW8bit, and torch AdamW
saved through ckptq's SavePlanner, side by side in one run (gloo on the CPU).

    python tools/bench_dist.py --layers 8 --width 1024 --worlds 1,2,4

For each world size the driver launches torchrun once per optimizer; every rank builds the same model
(``--layers`` Linear(width, width) blocks, each and the whole model wrapped in ``fully_shard``), takes two
steps, and reports the bytes of optimizer state it holds (local shards of every state tensor: codes,
scales, fp32 moments and steps; codebooks counted once per tensor) and its peak RSS; rank 0 then saves
model + optimizer with ``dcp.save`` and the driver measures the folder. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

import torch

VARIANTS = ("torch-adamw", "ckptq-adamw8bit", "torch-adamw+SavePlanner")


def _state_bytes(opt) -> int:
    total = 0
    for st in opt.state.values():
        for v in st.values():
            for t in (v.values() if isinstance(v, dict) else [v]):
                if isinstance(t, torch.Tensor):
                    t = t.to_local() if hasattr(t, "to_local") else t
                    total += t.numel() * t.element_size()
    return total


def worker(a) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    import ckptq.dcp
    from ckptq.optim import AdamW8bit

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(a.width, a.width) for _ in range(a.layers)])
    for block in model:
        fully_shard(block)
    fully_shard(model)
    opt = (AdamW8bit(model.parameters(), lr=1e-3) if a.variant == "ckptq-adamw8bit"
           else torch.optim.AdamW(model.parameters(), lr=1e-3))
    for _ in range(2):
        model(torch.randn(4, a.width)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    planner = ckptq.dcp.SavePlanner() if a.variant.endswith("SavePlanner") else None
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=a.dir, planner=planner)
    rss = torch.tensor([float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)])
    state = torch.tensor([float(_state_bytes(opt))])
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    dist.all_reduce(state, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in model.parameters())
        print(json.dumps({"state": state.item(), "rss_kb": rss.item(), "params": params}))
    dist.barrier()  # no rank tears gloo down while another still talks to it (SIGABRT otherwise)
    dist.destroy_process_group()


def drive(a) -> None:
    rows = []
    for world in [int(w) for w in a.worlds.split(",")]:
        for variant in VARIANTS:
            with tempfile.TemporaryDirectory() as d:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                       __file__, "--worker", "--variant", variant, "--dir", d, "--layers", str(a.layers),
                       "--width", str(a.width)]
                out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
                if out.returncode:
                    sys.exit(out.stderr[-2000:])
                r = json.loads(out.stdout.strip().splitlines()[-1])
                size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
                rows.append((world, variant, r["state"], r["params"], r["rss_kb"], size))
    params = rows[0][3]
    print(f"{params / 1e6:.1f} M parameters ({a.layers} x Linear({a.width}, {a.width})), FSDP2, gloo, CPU\n")
    print("| world | optimizer | state per rank | B/param per rank | x torch AdamW | peak RSS per rank | DCP folder |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    base = {(w, ): s for w, v, s, *_ in rows if v == "torch-adamw"}
    for world, variant, state, _, rss, size in rows:
        print(f"| {world} | {variant} | {state / 2**20:.1f} MB | {state / params:.3f} | {state / base[(world,)]:.3f} "
              f"| {rss / 1024:.0f} MB | {size / 2**20:.1f} MB |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    a = ap.parse_args()
    worker(a) if a.worker else drive(a)


if __name__ == "__main__":
    main()
