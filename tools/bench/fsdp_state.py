"""Optimizer state per parameter under FSDP2, by model width: torch AdamW, ckptq AdamW8bit and AdamW4bit, and
the DCP folder of each (and of torch AdamW saved through ckptq's LowBitSavePlanner), side by side (gloo, CPU).

    python tools/bench/fsdp_state.py --widths 128,200,576 --worlds 2,4

For each width and world size the driver launches torchrun once per optimizer; every rank builds the same
model, a 4-Linear MLP of width d (d -> 4d -> d -> 4d -> d, with biases; each Linear and the whole model
wrapped in ``fully_shard``, so dim 0 is sharded unevenly when it does not divide by the world size), takes
two steps, and reports the bytes of optimizer state it holds for the parameters with at least 4,096
elements (local codes, scales or fp32 moments; steps and codebooks left out), per local element of those
parameters, the worst rank; rank 0 then saves model + optimizer with ``dcp.save`` and the driver measures
the folder, and the folders ``ckptq convert`` (8 and 4 bits) makes of torch AdamW's. Targets (issue #19):
AdamW8bit <= 2.1 B/param, AdamW4bit <= 1.15 B/param at every width; torch AdamW's folder converted to
<= 0.55x (8 bits) and <= 0.45x (4 bits).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

VARIANTS = ("torch-adamw", "ckptq-adamw8bit", "ckptq-adamw4bit", "torch-adamw+LowBitSavePlanner")
MIN_SIZE = 4096


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", default="128,200,576")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--width", type=int, help=argparse.SUPPRESS)
    return ap


if __name__ == "__main__":
    build_parser().parse_args()  # --help and usage errors answer here, before torch and ckptq load

import torch  # noqa: E402


def _state_bytes(opt, params) -> tuple[int, int]:
    """(bytes of the moments' state, local elements) over the parameters with >= MIN_SIZE elements."""
    total = elements = 0
    for p in params:
        if p.numel() < MIN_SIZE:
            continue
        elements += (p.to_local() if hasattr(p, "to_local") else p).numel()
        for key, v in opt.state[p].items():
            if key == "step":
                continue
            for name, t in (v.items() if isinstance(v, dict) else [("", v)]):
                if isinstance(t, torch.Tensor) and name != "qmap":
                    t = t.to_local() if hasattr(t, "to_local") else t
                    total += t.numel() * t.element_size()
    return total, elements


def worker(a) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    import ckptq.dcp
    from ckptq.optim import AdamW4bit, AdamW8bit

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    d = a.width
    model = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d), torch.nn.Linear(d, 4 * d),
                                torch.nn.Linear(4 * d, d))
    for block in model:
        fully_shard(block)
    fully_shard(model)
    make = {"ckptq-adamw8bit": AdamW8bit, "ckptq-adamw4bit": AdamW4bit}.get(a.variant, torch.optim.AdamW)
    opt = make(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(4, d)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    planner = ckptq.dcp.LowBitSavePlanner() if a.variant.endswith("LowBitSavePlanner") else None
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=a.dir, planner=planner)
    state, elements = _state_bytes(opt, list(model.parameters()))
    per = torch.tensor([state / max(elements, 1)])
    dist.all_reduce(per, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in model.parameters())
        print(json.dumps({"per_param": per.item(), "params": params}))
    dist.barrier()  # no rank tears gloo down while another still talks to it (SIGABRT otherwise)
    dist.destroy_process_group()


def _launch(a, world: int, width: int, variant: str, folder: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", __file__,
           "--worker", "--variant", variant, "--dir", folder, "--width", str(width)]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode:
        sys.exit(out.stderr[-2000:])
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["folder"] = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    return r


def _converted(folder: str, bits: int) -> int:
    """Bytes of ``ckptq convert FOLDER --bits BITS`` (written beside it, measured, removed)."""
    out = f"{folder}.q{bits}"
    r = subprocess.run([sys.executable, "-m", "ckptq", "convert", folder, "--bits", str(bits), "--min-size",
                        str(MIN_SIZE), "-o", out], capture_output=True, text=True)
    if r.returncode:
        sys.exit(r.stderr[-2000:])
    try:
        return sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    finally:
        shutil.rmtree(out)


def drive(a) -> None:
    print("| width | world | optimizer | state B/param (params >= 4,096, worst rank) | DCP folder | x torch AdamW's |")
    print("|---:|---:|---|---:|---:|---:|")
    for width in [int(w) for w in a.widths.split(",")]:
        for world in [int(w) for w in a.worlds.split(",")]:
            base = None
            for variant in VARIANTS:
                with tempfile.TemporaryDirectory() as d:
                    r = _launch(a, world, width, variant, d)
                    converted = {bits: _converted(d, bits) for bits in (8, 4)} if variant == "torch-adamw" else {}
                base = base or r["folder"]
                print(f"| {width} | {world} | {variant} | {r['per_param']:.3f} | {r['folder'] / 2**20:.2f} MB "
                      f"| {r['folder'] / base:.2f}x |", flush=True)
                for bits, size in converted.items():
                    print(f"| {width} | {world} | torch-adamw, ckptq convert{' --bits 4' if bits == 4 else ''} | - "
                          f"| {size / 2**20:.2f} MB | {size / base:.2f}x |", flush=True)


def main() -> None:
    a = build_parser().parse_args()
    worker(a) if a.worker else drive(a)


if __name__ == "__main__":
    main()
