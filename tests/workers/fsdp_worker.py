"""One rank of an FSDP2 run (launched by tests/dcp/test_distributed.py through torchrun, gloo on the CPU).

    python -m tests.workers.fsdp_worker OPT START STOP [--load DIR] [--save DIR] [--wrap fsdp|ddp|plain] --out FILE
    python -m tests.workers.fsdp_worker --plan FILE   (FILE: a JSON list of such argument lists, run one after another)

Trains a small model with every block and the model wrapped in ``fully_shard`` (or DDP, or nothing), on the same batch on
every rank (so the averaged gradient equals one process's), optionally resuming from / saving a DCP
checkpoint (``get_state_dict`` / ``set_state_dict``), and writes rank 0's losses and the full (gathered)
optimizer state to FILE as a torch.save file. With --plan, one launch runs several such runs in turn, each
with its own freshly seeded model and optimizer (as a launch of its own has them), so that a later run can
load what an earlier one saved without paying for another launch.
"""

import argparse
import json

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import ckptq.dcp
from ckptq.optim import AdamW8bit, Lion8bit, Muon8bit, SGD8bit

# ckptq's one-state optimizers (Muon8bit on the hidden matrices only: Muon takes 2-D parameters, not embeddings)
ONE_STATE = {"sgd8bit": lambda ps, b: SGD8bit(ps, lr=0.05, momentum=0.9, nesterov=True, min_size=1024, backend=b),
             "lion8bit": lambda ps, b: Lion8bit(ps, lr=1e-3, weight_decay=0.1, min_size=1024, backend=b),
             "muon8bit": lambda ps, b: Muon8bit(ps, lr=0.02, min_size=1024, backend=b)}


def model_and_opt(name: str, backend: str = "auto", wrap: str = "fsdp"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(64, 256),  # rows of 256: 8-bit state, sharded by rows
        torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256), torch.nn.LayerNorm(256),
        torch.nn.Linear(256, 96),  # rows of 256 too; bias and LayerNorm below min_size: fp32 state
        torch.nn.Linear(96, 10),  # below min_size: fp32 (DTensor) state
    )
    if wrap == "fsdp":
        for block in model:
            if any(True for _ in block.parameters()):
                fully_shard(block)
        fully_shard(model)
    elif wrap == "ddp":
        model = DDP(model)
    if name == "adamw8bit":
        return model, AdamW8bit(model.parameters(), lr=1e-2, min_size=1024, backend=backend)
    if name in ONE_STATE:
        params = [p for n, p in model.named_parameters() if name != "muon8bit" or (p.ndim == 2 and not n.startswith("0."))]
        return model, ONE_STATE[name](params, backend)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model, opt, start: int, stop: int) -> list[float]:
    losses = []
    for step in range(start, stop):
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, 64, (16,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(idx), (idx * 7 + 3) % 10)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("opt")
    ap.add_argument("start", type=int)
    ap.add_argument("stop", type=int)
    ap.add_argument("--load")
    ap.add_argument("--save")
    ap.add_argument("--out", required=True)
    ap.add_argument("--planners", action="store_true", help="save/load through ckptq.dcp's planner pair")
    ap.add_argument("--flat", action="store_true", help="flatten_optimizer_state_dict, as torchtitan saves")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--wrap", choices=["fsdp", "ddp", "plain"], default="fsdp",
                    help="fully_shard every block (default), DistributedDataParallel, or no wrapper")
    return ap


def run(a: argparse.Namespace) -> None:
    model, opt = model_and_opt(a.opt, a.backend, a.wrap)
    flat = StateDictOptions(flatten_optimizer_state_dict=a.flat)
    if a.load:
        msd, osd = get_state_dict(model, opt, options=flat)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=a.load, planner=ckptq.dcp.LowBitLoadPlanner() if a.planners else None)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=flat)
    losses = train(model, opt, a.start, a.stop)
    msd, osd = get_state_dict(model, opt, options=flat)
    if a.save:
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=a.save,
                 planner=ckptq.dcp.LowBitSavePlanner(min_size=1024) if a.planners else None)
    full = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))[1]
    local_bytes = sum(t.to_local().numel() * t.element_size() for st in opt.state.values()
                      for v in st.values() for t in (v.values() if isinstance(v, dict) else [v])
                      if isinstance(t, torch.Tensor) and hasattr(t, "to_local"))
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "optim": full, "world": dist.get_world_size(),
                    "local_state_bytes": local_bytes}, a.out)
    dist.barrier()  # every rank is done with this run (its folder written) before the next one starts


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--plan", help="a JSON file: a list of argument lists, one run each, run in turn")
    plan, rest = ap.parse_known_args()
    runs = json.load(open(plan.plan)) if plan.plan else [rest]
    dist.init_process_group("gloo")
    for args in runs:
        run(parser().parse_args(args))
    dist.barrier()  # no rank tears gloo down while another still talks to it (SIGABRT otherwise)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
