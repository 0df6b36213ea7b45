"""The FSDP2 path on a GPU (part of tools/scripts/gpu_check.sh): AdamW8bit's Triton step on DTensor shards over
NCCL, against the same model without FSDP on the same device, then a DCP save and resume.

    torchrun --standalone --nproc-per-node 1 tools/scripts/gpu_fsdp_check.py          # NCCL, CUDA
    torchrun --standalone --nproc-per-node 2 tools/scripts/gpu_fsdp_check.py --cpu    # gloo smoke test

Every rank trains on the same batch, so the averaged gradient equals one process's and the losses must
match the unsharded run exactly; prints one line per check and exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import sys
import tempfile


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU (a smoke test of this script)")
    return ap


if __name__ == "__main__":
    build_parser().parse_args()  # --help and usage errors answer here, before torch and ckptq load

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from ckptq.optim import AdamW8bit  # noqa: E402


def build(device: str, shard: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(512, 1024), torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                torch.nn.Linear(4096, 1024), torch.nn.Linear(1024, 512)).to(device)
    if shard:
        for block in model:
            if any(True for _ in block.parameters()):
                fully_shard(block)
        fully_shard(model)
    return model, AdamW8bit(model.parameters(), lr=1e-3)


def train(model, opt, device: str, start: int, stop: int) -> list[float]:
    losses = []
    for step in range(start, stop):
        idx = torch.randint(0, 512, (64,), generator=torch.Generator().manual_seed(step)).to(device)
        loss = torch.nn.functional.cross_entropy(model(idx), (idx * 7 + 3) % 512)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    a = build_parser().parse_args()
    device = "cpu" if a.cpu else "cuda"
    dist.init_process_group("gloo" if a.cpu else "nccl")
    if not a.cpu:
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    ref = train(*build(device, False), device, 0, 6)
    model, opt = build(device, True)
    first = train(model, opt, device, 0, 3)
    with tempfile.TemporaryDirectory() as mine:
        shared = [mine]
        dist.broadcast_object_list(shared, src=0)  # one folder for every rank: rank 0's
        d = shared[0]
        dcp.save(dict(zip(("model", "optim"), get_state_dict(model, opt))), checkpoint_id=d)
        model, opt = build(device, True)
        train(model, opt, device, 0, 1)  # a template with state
        sd = dict(zip(("model", "optim"), get_state_dict(model, opt)))
        dcp.load(sd, checkpoint_id=d)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        dist.barrier()  # rank 0 removes the folder on leaving the block
    second = train(model, opt, device, 3, 6)
    # On the CPU the losses are equal bit for bit; on CUDA the sharded and unsharded models may pick other
    # matmul algorithms, so the check asks for agreement to 1e-5 and reports how close it is.
    rel = [abs(a - b) / abs(b) for a, b in zip(first + second, ref)]
    ok = max(rel) < 1e-5
    if dist.get_rank() == 0:
        print(f"FSDP2 + AdamW8bit on {device}, world {dist.get_world_size()}: losses "
              f"{'equal' if first + second == ref else 'agree' if ok else 'DIFFER'} to the unsharded run through a "
              f"DCP save/resume (max relative difference {max(rel[:3]):.1e} before the save, {max(rel[3:]):.1e} after; "
              f"last {ref[-1]:.6f} vs {second[-1]:.6f})")
    dist.barrier()  # no rank tears gloo down while another still talks to it (SIGABRT otherwise)
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
