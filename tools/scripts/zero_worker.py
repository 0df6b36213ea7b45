"""One DeepSpeed ZeRO training process (run under torchrun, CPU, gloo): trains a small MLP on fixed
batches, saves a checkpoint, or resumes from one and continues; writes the losses it saw as JSON.

    torchrun --standalone --nproc-per-node 2 tools/scripts/zero_worker.py --stage 2 --steps 6 --save-at 3 \
        --save-dir out/zero2 --losses out/full.json
    torchrun --standalone --nproc-per-node 2 tools/scripts/zero_worker.py --stage 2 --steps 6 --load-dir out/zero2 \
        --losses out/resumed.json
    torchrun --standalone --nproc-per-node 2 tools/scripts/zero_worker.py --stage 1 2 3 --steps 6 --save-at 3 \
        --save-dir 'out/zero{stage}' --losses 'out/full{stage}.json'

Several stages in one launch run one after the other in the same processes (one start of torch and
DeepSpeed, one process group), each with its own model, engine and files: ``{stage}`` in --save-dir,
--load-dir and --losses stands for the stage.

Used by tools/scripts/make_zero_fixtures.py, tools/bench/zero_sizes.py and tests/deepspeed/test_zero.py (the end-to-end test).
Every rank sees its own batches (seeded by step and rank), so data parallelism is real.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", type=int, nargs="+", required=True, choices=(0, 1, 2, 3),
                    help="ZeRO stage; several run one after the other ({stage} in the paths names each)")
    ap.add_argument("--steps", type=int, required=True, help="train until this global step")
    ap.add_argument("--save-at", type=int, default=0, help="save a checkpoint after this many steps")
    ap.add_argument("--save-dir")
    ap.add_argument("--load-dir", help="resume from this save dir (its `latest` tag)")
    ap.add_argument("--losses", required=True, help="JSON file for rank 0's losses, by step")
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--universal", action="store_true", help="with --load-dir: load its universal checkpoint")
    return ap


if __name__ == "__main__":
    build_parser().parse_args()  # --help and usage errors answer here, before torch and ckptq load

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402


def make_model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(16, width), torch.nn.GELU()]
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    layers += [torch.nn.LayerNorm(width), torch.nn.Linear(width, 8)]
    return torch.nn.Sequential(*layers)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, 16, generator=g)
    return x, (x[:, :8] * 2 - x[:, 8:]).tanh()


def engine_for(args: argparse.Namespace, stage: int):
    import deepspeed

    # DeepSpeed's shared-memory all-reduce is a C++ op compiled on first use (~80 s); gloo's own
    # all-reduce is all these tiny runs need. Its op table is cached in the module and meant to be edited.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    model = make_model(args.width, args.depth)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if args.bf16:
        config["bf16"] = {"enabled": True}
    if args.universal:  # resume from the save dir's latest_universal (ds_to_universal output)
        config["checkpoint"] = {"load_universal": True}
    # A client torch AdamW: DeepSpeed's own (FusedAdam / CPUAdam) would compile a C++ op first (~4 min).
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def launch(*args: str, nproc: int = 2, timeout: int = 600) -> None:
    """Run this worker under torchrun (``--standalone``, ``nproc`` CPU processes); RuntimeError with the
    tail of its output if it fails. The worker imports ckptq from this checkout."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.abspath(__file__), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd[3:])} failed:\n{(r.stdout + r.stderr)[-3000:]}")


def main() -> None:
    args = build_parser().parse_args()
    torch.set_num_threads(1)
    for stage in args.stage:
        run(args, stage)
    torch.distributed.destroy_process_group()


def run(args: argparse.Namespace, stage: int) -> None:
    """Train (or resume) at ``stage``, save where asked, write rank 0's losses."""
    def path(template):
        return template.replace("{stage}", str(stage)) if template else template

    engine = engine_for(args, stage)
    rank = torch.distributed.get_rank()
    start = 0
    if args.load_dir:
        _, client = engine.load_checkpoint(path(args.load_dir))
        start = client["step"]
    losses = {}
    for step in range(start, args.steps):
        x, y = batch(step, rank)
        out = engine(x.to(torch.bfloat16) if args.bf16 else x)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        engine.backward(loss)
        engine.step()
        losses[step] = loss.item()
        if args.save_dir and step + 1 == args.save_at:
            engine.save_checkpoint(path(args.save_dir), client_state={"step": step + 1})
    if rank == 0:
        with open(path(args.losses), "w") as f:
            json.dump(losses, f)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
