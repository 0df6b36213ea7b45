"""Which split of 8 bits per parameter between the two moments gives the best 4-bit-budget state?

At 4 bits per value (block 128, one fp32 scale per block and moment: 1.0625 bytes per parameter) the
update error at a checkpoint is the ratio r = m / (sqrt(v) + eps')'s own rounding error (v's cancels), so
bits moved from v to r buy update fidelity, and cost the second moment's precision in the steps after.
This tool simulates splits in plain PyTorch (fake quantization: quantize, then decode, in fp32) before
any kernel or file format is built for them. It found the 6 + 2 layout of ``ckptq convert --bits 4``;
``AdamW4bit`` trains on 4 + 4, because ``--resume`` below starts from a trained state and does not show
what a 2-bit sqrt(v) does from the first step (README, "4-bit state": it freezes).

  R bits for r: a Lloyd-Max codebook for block-normalized Gaussian values with -1, 0, +1 fixed (as
                ``ckptq.codebooks.LLOYD_GAUSSIAN_128`` at 4 bits), rounded to nearest at conversion and
                stochastically in the step (as the 4-bit step does);
  V bits for v: sqrt(v) rounded to nearest on ``--v-map``: ``power``, the unsigned power map
                (k / K) ** exponent (ckptq's 4-bit map: exponent 3); ``geometric``, 3 ** (k - K) (no zero:
                1/27, 1/9, 1/3, 1 at 2 bits); ``linear``, (k + 1) / (K + 1) (no zero);
  the same budget whenever R + V = 8.

Reported: (1) on each checkpoint given, the worst and median update error per tensor (relative L2, as
``tools/fidelity.py``, tensors of >= 4096 elements), (2) with ``--resume``, the mean loss of 300 steps
resumed from ``tools/resume_fidelity.py``'s checkpoint (mid model, 400 torch AdamW steps) with the state
fake-quantized after every step, against torch AdamW resumed from the fp32 state.

    python tools/bit_split.py ck30.pt ck400.pt --split 4,4 --split 5,3 --split 6,2 --resume
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fidelity  # noqa: E402  (tools/ is not a package)
import resume_fidelity as rf  # noqa: E402

from ckptq.codec import ops  # noqa: E402
from ckptq.kernels import backend_torch  # noqa: E402

BLOCK = 128
MIN_NUMEL = 4096


@functools.lru_cache(maxsize=None)
def lloyd_map(levels: int, iterations: int = 100) -> torch.Tensor:
    """Least-squares codebook of ``levels`` entries for blocks of 128 Gaussian values divided by their absmax,
    with -1, 0 and +1 kept as entries (20,000 blocks of torch.randn, seed 0)."""
    x = torch.randn(20000, BLOCK, generator=torch.Generator().manual_seed(0))
    y = (x / x.abs().amax(1, keepdim=True)).reshape(-1)
    q = torch.linspace(-1, 1, levels)
    for _ in range(iterations):
        idx = torch.searchsorted((q[1:] + q[:-1]) / 2, y)
        total = torch.zeros(levels).index_add_(0, idx, y)
        count = torch.zeros(levels).index_add_(0, idx, torch.ones_like(y))
        q = torch.where(count > 0, total / count.clamp(min=1), q)
        q[0], q[-1] = -1.0, 1.0
        q[torch.argmin(q.abs())] = 0.0
    return q


def v_map(bits: int, kind: str, exponent: float) -> torch.Tensor:
    """The 2**bits-entry codebook of sqrt(v) / block absmax, ascending, ending at 1."""
    k = torch.arange(2**bits, dtype=torch.float64)
    top = 2**bits - 1
    if kind == "power":
        return (k / top).pow(exponent).float()
    if kind == "geometric":
        return torch.pow(3.0, k - top).float()
    return ((k + 1) / (top + 1)).float()  # linear


def fake_quantize(x: torch.Tensor, qmap: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
    """Blockwise absmax quantization of x on qmap and back, with ckptq's reference rounding (to nearest,
    or stochastic with ``gen``'s uniforms instead of the step's hashed ones)."""
    n = x.numel()
    nb = -(-n // BLOCK)
    blocks = torch.nn.functional.pad(x.reshape(-1).float(), (0, nb * BLOCK - n)).view(nb, BLOCK)
    codes, absmax = backend_torch.reference_codes(blocks.view(-1), ops.midpoints(qmap), BLOCK)
    codes = codes.view(nb, BLOCK)
    if gen is not None:
        codes = backend_torch.stochastic_codes(blocks, absmax, codes, qmap, torch.rand(blocks.shape, generator=gen))
    return (qmap[codes.long()] * absmax[:, None]).reshape(-1)[:n].view(x.shape)


@functools.lru_cache(maxsize=None)
def _maps(split: tuple[int, int], v_kind: tuple[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    return lloyd_map(2 ** split[0]), v_map(split[1], *v_kind)


def fake_state(m, v, step: float, group: dict, split, v_kind: tuple[str, float], gen=None):
    """(m, v) as they would decode after being stored with ``split`` = (R, V) bits; ``v_kind``: (map, exponent)."""
    r_map, s_map = _maps(tuple(split), tuple(v_kind))
    eps = group["eps"] * (1 - group["betas"][1] ** step) ** 0.5
    s = v.sqrt()
    s_q = fake_quantize(s, s_map)
    r_q = fake_quantize(m / (s + eps), r_map, gen)
    return r_q * (s_q + eps), s_q * s_q


def update_errors(path: str, split, v_kind: tuple[str, float]) -> tuple[float, float]:
    """(worst, median) relative update error over the checkpoint's Adam states of >= 4096 elements."""
    opt = fidelity.find_optimizer_state(torch.load(path, weights_only=True))
    groups, errors = fidelity._group_of(opt), []
    for pid, st in opt["state"].items():
        m, v = st.get("exp_avg"), st.get("exp_avg_sq")
        if not isinstance(m, torch.Tensor) or m.numel() < MIN_NUMEL:
            continue
        g, step = groups[pid], float(st["step"])
        m_q, v_q = fake_state(m, v, step, g, split, v_kind)
        want = fidelity.adam_update(m, v, step, g["betas"], g["eps"])
        errors.append(fidelity.rel_err(fidelity.adam_update(m_q, v_q, step, g["betas"], g["eps"]), want))
    return max(errors), statistics.median(errors)


class FakeQuantAdamW(torch.optim.AdamW):
    """torch AdamW whose large states are fake-quantized after every step (stochastic rounding of r)."""

    def __init__(self, params, split, v_kind: tuple[str, float], **kwargs):
        super().__init__(params, foreach=False, **kwargs)
        self.split, self.v_kind, self.gen = split, v_kind, torch.Generator().manual_seed(1)

    @torch.no_grad()
    def requantize(self, gen) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if p.numel() >= MIN_NUMEL and "exp_avg" in st:
                    m, v = fake_state(st["exp_avg"], st["exp_avg_sq"], float(st["step"]), group, self.split,
                                      self.v_kind, gen)
                    st["exp_avg"].copy_(m)
                    st["exp_avg_sq"].copy_(v)

    def step(self, closure=None):
        loss = super().step(closure)
        self.requantize(self.gen)
        return loss


def resume_curves(splits, v_kind: tuple[str, float], seed: int, steps: int) -> dict[str, list[float]]:
    """Loss curves after resuming resume_fidelity's checkpoint: fp32, then each split."""
    size, lr = "mid", rf.mc.LEARNING_RATE
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt.pt")
        perm = rf.pretrain(size, 400, lr, seed, path)
        cfg, batch_size = rf.model_config(size)
        data = rf.batches(cfg, batch_size, perm, steps, seed + 2)
        curves: dict[str, list[float]] = {}
        torch.manual_seed(seed)
        model, opt = rf.start("fp32", size, lr, {"fp32": path})
        rf.train_steps(model, opt, data, curves.setdefault("fp32", []))
        ckpt = torch.load(path, weights_only=True)
        for split in splits:
            torch.manual_seed(seed)
            model = rf.mc.GPT(**cfg)
            model.load_state_dict(ckpt["model"])
            opt = FakeQuantAdamW(rf.param_groups(model, lr), split, v_kind, lr=lr)
            opt.load_state_dict(copy.deepcopy(ckpt["optimizer"]))  # torch keeps the tensors it is given
            opt.requantize(None)  # conversion: rounded to nearest
            rf.train_steps(model, opt, data, curves.setdefault(f"{split[0]}+{split[1]}", []))
    return curves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="*", help="torch checkpoints with AdamW state (tools/make_checkpoint.py)")
    parser.add_argument("--split", action="append", default=[], help="R,V: bits for the ratio and for sqrt(v)")
    parser.add_argument("--v-map", choices=("power", "geometric", "linear"), default="power",
                        help="codebook of sqrt(v) (see above)")
    parser.add_argument("--v-exponent", type=float, default=3.0, help="exponent of sqrt(v)'s power map")
    parser.add_argument("--resume", action="store_true", help="also resume training (~1 min per split)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    splits = [tuple(int(b) for b in s.split(",")) for s in args.split or ["4,4"]]
    v_kind = (args.v_map, args.v_exponent)
    print(f"sqrt(v) map {args.v_map}" + f" (k/K)^{args.v_exponent:g}" * (args.v_map == "power")
          + f", block {BLOCK}, {(sum(splits[0]) / 8 + 8 / BLOCK):.4f} B/param\n")
    print("| split R+V | " + " | ".join(f"{os.path.basename(c)} worst / median" for c in args.checkpoints) + " |")
    print("|---|" + "---:|" * len(args.checkpoints))
    for split in splits:
        cells = [update_errors(c, split, v_kind) for c in args.checkpoints]
        print(f"| {split[0]}+{split[1]} | " + " | ".join(f"{100 * w:.2f}% / {100 * m:.2f}%" for w, m in cells) + " |")
    if args.resume:
        curves = resume_curves(splits, v_kind, args.seed, args.steps)
        ref = statistics.fmean(curves.pop("fp32"))
        print(f"\nresumed {args.steps} steps (seed {args.seed}), mean loss vs fp32 {ref:.4f}:")
        for name, losses in curves.items():
            mean = statistics.fmean(losses)
            print(f"  {name}: {mean:.4f} ({100 * (mean - ref) / ref:+.3f}%)")


if __name__ == "__main__":
    main()
