"""Kernel-level GPU benchmark of the grouped Triton steps: ms per step and GB/s against the bytes the update
must move, beside torch's fused AdamW and a device copy (the bandwidth anchor), in one run.

Each layout is a model's tensor shapes (no weights): tensors of at least 4,096 elements get low-bit state
(the optimizer's min_size), the others fp32 moments (``triton_group.dense``). Rows, interleaved round by
round so that clocks and other processes hit all alike, timed with CUDA events:

    torch fused     torch.optim.AdamW(fused=True).step(): fp32 moments, 28 B/param at fp32 params
    8-bit group     triton_group.step, rule adam (8-bit ratio + 8-bit sqrt(v), block 256) + triton_group.dense, eager
    8-bit graph     the same two calls captured in one CUDA graph and replayed (no host work at all)
    4-bit group     6-bit ratio + 2-bit sqrt(v), block 128, seeded (stochastic) rounding, eager
    8-bit per-param backend_triton.adam_step on each parameter in turn (a group of one): what grouping saves
    copy            dst.copy_(src) of 1 GiB: read + write, the reachable bandwidth

Bytes per parameter: param read + write, grad read, and per moment its codes and block scales read and
written (8-bit state at fp32 params: 8 + 4 + 2 * (1 + 4 / 256) * 2 = 16.06, "16.1 B"); the dense part
counts 28 B.

    python tools/bench/triton_steps.py [--layout 16.8m,gpt2-124m,llama-1b,many-small] [--rounds 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default="16.8m,gpt2-124m,llama-1b,many-small")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--bf16", action="store_true", help="bf16 params and grads (torch fused stays fp32)")
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help and usage errors answer here, before torch and ckptq load

import torch  # noqa: E402

LAYOUTS = {
    "16.8m": lambda: [(4096, 1024)] * 4,
    "many-small": lambda: [(64, 64)] * 256,
    "gpt2-124m": lambda: [(50257, 768), (1024, 768)] + 12 * [(768,), (768,), (2304, 768), (2304,), (768, 768), (768,),
                                                             (768,), (768,), (3072, 768), (3072,), (768, 3072), (768,)]
    + [(768,), (768,)],
    "llama-1b": lambda: [(128256, 2048)] + 16 * [(2048,), (2048, 2048), (512, 2048), (512, 2048), (2048, 2048),
                                                 (2048,), (8192, 2048), (8192, 2048), (2048, 8192)] + [(2048,)],
}
MIN_SIZE = 4096


def _hyper(t: int, device) -> torch.Tensor:
    from ckptq.optim import adam

    return torch.stack([adam.hyper_tensor(1e-3, 0.9, 0.999, 1e-8, 0.01, 10, True) for _ in range(t)]).to(device)


def _full_hyper(t: int, device) -> torch.Tensor:
    """fp32 [t, 10]: the 8 Adam scalars and the two ratio eps (HYPER_FIELDS)."""
    return torch.cat([_hyper(t, device), torch.full((t, 2), 1e-9, device=device)], 1)


class Setup:
    """One layout's parameters, gradients and states for every row of the table."""

    def __init__(self, shapes, device, dtype):
        gen = torch.Generator(device).manual_seed(0)
        self.params = [torch.randn(s, device=device, generator=gen).to(dtype) for s in shapes]
        self.grads = [torch.randn(s, device=device, generator=gen).to(dtype) * 1e-3 for s in shapes]
        self.big = [i for i, p in enumerate(self.params) if p.numel() >= MIN_SIZE]
        self.small = [i for i, p in enumerate(self.params) if p.numel() < MIN_SIZE]
        self.torch_params = [p.float().clone().requires_grad_() for p in self.params]
        for p, g in zip(self.torch_params, self.grads):
            p.grad = g.float()
        self.fused = torch.optim.AdamW(self.torch_params, lr=1e-3, weight_decay=0.01, fused=True)
        self.groups = {bits: self._step_group(bits, device) for bits in (8, 4)}
        self.dense = self._dense_group(device)

    def _step_group(self, bits: int, device):
        from ckptq.codec import ops, policy
        from ckptq.kernels.contract import RATIO, SQRT, Group, GroupMember, Slot

        widths, block = ((8, 8), 256) if bits == 8 else ((6, 2), 128)
        maps = (policy.ratio_policy(widths[0]).qmap().to(device), policy.policy_for("exp_avg_sq", widths[1]).qmap().to(device))
        members = []
        for i in self.big:
            p = self.params[i]
            row_len = p.shape[1] if p.dim() == 2 else None
            m = ops.quantize_blockwise(torch.randn_like(p, dtype=torch.float32) * 1e-3, maps[0], block, bits=widths[0],
                                       row_len=row_len)
            v = ops.quantize_blockwise(torch.rand_like(p, dtype=torch.float32) * 1e-6, maps[1], block, "sqrt",
                                       bits=widths[1], row_len=row_len)
            members.append(GroupMember(p.view(-1), (m[0], v[0]), (m[1], v[1]), row_len or p.numel()))
        slots = (Slot(maps[0], ops.midpoints(maps[0]).contiguous(), maps[0], widths[0], RATIO, RATIO, 1),
                 Slot(maps[1], ops.midpoints(maps[1]).contiguous(), maps[1], widths[1], SQRT, SQRT))
        seeds = torch.arange(len(members), device=device) * 7919 if bits == 4 else None
        return Group("adam", 0, tuple(members), tuple(self.grads[i].view(-1) for i in self.big), (),
                     _full_hyper(len(members), device), seeds, slots, block, {})

    def _dense_group(self, device):
        from ckptq.kernels.contract import Dense

        params = tuple(self.params[i].view(-1) for i in self.small)
        moments = tuple((torch.zeros(p.numel(), device=device), torch.zeros(p.numel(), device=device)) for p in params)
        return Dense("adam", 0, params, tuple(self.grads[i].view(-1) for i in self.small), moments, (),
                     _full_hyper(len(params), device), {})

    def bytes_moved(self, bits: int) -> int:
        """The least traffic of one step: p read + write, g read, each moment's codes and scales both ways."""
        per_state = (1.0 + 4 / 256) * 2 if bits == 8 else (6 / 8 + 4 / 128) + (2 / 8 + 4 / 128)
        quantized = sum(self.params[i].numel() * (3 * self.params[i].element_size() + 2 * per_state) for i in self.big)
        dense = sum(self.params[i].numel() * (3 * self.params[i].element_size() + 16) for i in self.small)
        return int(quantized + dense)


def _grouped(setup: Setup, bits: int):
    from ckptq.kernels import triton_group

    def run():
        triton_group.step(setup.groups[bits])
        if setup.small:
            triton_group.dense(setup.dense)
    return run


def _per_param(setup: Setup):
    from ckptq.kernels import backend_triton, triton_group
    from ckptq.kernels.contract import StepFlags, StepState

    group, hyper = setup.groups[8], setup.groups[8].hyper.cpu()

    def run():
        for k, (m, g) in enumerate(zip(group.members, group.grads)):
            states = tuple(StepState(c, a, s.qmap, s.thresholds, s.encode, 8)
                           for c, a, s in zip(m.codes, m.absmax, group.slots))
            backend_triton.adam_step(m.p, g, states, hyper[k], StepFlags(group.block_size, True, False, None, m.row_len))
        if setup.small:
            triton_group.dense(setup.dense)
    return run


def _graphed(run):
    run()  # the eager step before capture builds the caches
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph.replay


def _time(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def bench_layout(name: str, rounds: int, dtype) -> list[tuple]:
    setup = Setup(LAYOUTS[name](), "cuda", dtype)
    src = torch.empty(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    n = sum(p.numel() for p in setup.params)
    rows = {"torch fused": (setup.fused.step, n * (3 * 4 + 16)),
            "8-bit group": (_grouped(setup, 8), setup.bytes_moved(8)),
            "8-bit graph": (_graphed(_grouped(setup, 8)), setup.bytes_moved(8)),
            "4-bit group": (_grouped(setup, 4), setup.bytes_moved(4)),
            "8-bit per-param": (_per_param(setup), setup.bytes_moved(8)),
            "copy 1 GiB": (lambda: dst.copy_(src), 2 * src.numel() * 4)}
    for fn, _ in rows.values():  # warm up: compile, build caches
        fn()
    times = {k: [] for k in rows}
    for _ in range(rounds):
        for k, (fn, _) in rows.items():
            times[k].append(_time(fn))
    copy_gbs = rows["copy 1 GiB"][1] / statistics.median(times["copy 1 GiB"]) / 1e6
    fused = statistics.median(times["torch fused"])
    out = []
    for k, (_, nbytes) in rows.items():
        ms = statistics.median(times[k])
        gbs = nbytes / ms / 1e6
        out.append((name, k, ms, gbs, gbs / copy_gbs, ms / fused, nbytes / n if k != "copy 1 GiB" else float("nan")))
    return out


def main() -> int:
    args = build_parser().parse_args()
    if not torch.cuda.is_available():
        print("triton_steps.py times CUDA kernels: no CUDA device here", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, params {dtype}; medians of {args.rounds} rounds\n")
    print("| layout | step | ms | GB/s | of copy | vs fused | B/param |\n|---|---|--:|--:|--:|--:|--:|")
    for name in args.layout.split(","):
        for row in bench_layout(name, args.rounds, dtype):
            print("| {} | {} | {:.3f} | {:.0f} | {:.0%} | {:.2f}x | {:.1f} |".format(*row))
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
