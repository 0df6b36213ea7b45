"""Run under torchrun with 4 ranks: a 2 x 2 DeviceMesh (data parallel x tensor parallel) on gloo. A
column-parallel Linear (its weight Shard(0) on the TP dim) and a row-parallel one (Shard(1)), both
fully_shard-ed on the DP dim; AdamW8bit steps them. Writes {name: (low-bit?, placements)} and the warnings
rank 0 saw to --out (JSON)."""

import argparse
import json
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ckptq.optim import AdamW8bit


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256, bias=False), torch.nn.Linear(256, 128, bias=False))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = AdamW8bit(model.named_parameters(), lr=1e-2, min_size=1024)
    x = torch.randn(8, 128)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    held = {name: (isinstance(opt.state[p]["exp_avg"], dict), [str(pl) for pl in p.placements])
            for name, p in model.named_parameters()}
    if dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump({"held": held, "warnings": [str(w.message) for w in seen]}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
