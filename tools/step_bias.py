"""Where does low-bit Adam state drift from fp32 when training from scratch? An fp32 shadow beside the
quantized optimizer, per step, per moment, per tensor.

The model trains with a quantized optimizer (``--variant``: ``ckptq`` = AdamW8bit, ``ckptq4`` = AdamW4bit,
or any variant registered in ``resume_fidelity.SCRATCH_FACTORIES``) in a from-scratch setting of
``tools/resume_fidelity.py`` (its default: the mid Zipf model; ``--preset issue23``: issue 23's byte-level
GPT-2 on English text). For every parameter with quantized state it keeps the fp32 moments torch AdamW
would hold on the same gradients (the shadow m*, v*) and, at every step, measures:

  u        the update direction m_hat / (sqrt(v_hat) + eps) that the quantized step applied (computed from
           its decoded state and this gradient exactly as its kernels do) against the shadow's u*:
           relative L2 error ||u - u*|| / ||u*||, and the bias along u*, <u - u*, u*> / ||u*||^2 (< 0:
           shorter steps than fp32's on the same gradients)
  m, v     the decoded moments after the step against the shadow (the drift accumulated so far): relative
           L2 error; m's bias mean((m - m*) sign(m*)) / mean|m*| (< 0: m shrunk towards 0); v's linear bias
           sum(v - v*) / sum(v*) (``v_lin``) and geometric bias exp(mean log(sqrt(v) / sqrt(v*))) - 1
           (``v_bias``; unbiased noise alone makes it negative), the latter also by decade of v* below its
           block's largest v*
  r, s     this step's own rounding (requantization) error: the stored ratio r = m / (sqrt(v) + eps') and
           s = sqrt(v) against the exact fp32 values the kernel rounded; r's bias as m's, s's linear
           (``s_lin``) and geometric (``s_bias``) as v's
  stale    of the elements whose exact value moved by more than 0.01% this step, the share whose code did not
           change (r and s); with its signed error (``stale_s_bias``: mean log(s_q / s_exact) over them)

Metrics are kept as sums per tensor and step, so tensors and steps pool exactly (``--json`` writes the
sums). Reports: pooled over all quantized tensors at chosen steps, and per tensor over windows of steps.

    python tools/step_bias.py --preset issue23 --variant ckptq --steps 300
    python tools/step_bias.py --variant ckptq4 --steps 300 --json /tmp/bias4.json
    python tools/step_bias.py --preset issue23 --seed 1 --variant ckptq4 --steps 1000 --windows 1-30,31-100,101-1000
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_checkpoint as mc  # noqa: E402  (tools/ is not a package)
import resume_fidelity as rf  # noqa: E402

from ckptq.codec import ops, policy, qstate  # noqa: E402
from ckptq.kernels import backend_torch, contract  # noqa: E402
from ckptq.optim import adam  # noqa: E402

MOVED = 1e-4  # "moved": the exact value changed by more than this, relative, in one step
DECADES = 7  # v bias bins: v* within 10**-(k+1) .. 10**-k of its block's largest v*, the last open-ended
SHOW_STEPS = (1, 2, 3, 5, 10, 20, 30, 50, 100, 200, 300, 500, 1000)


def unpack(q: qstate.QState, n: int) -> torch.Tensor:
    """A quantized state's codes, one uint8 per element, flat [n] (a copy: the step rewrites them)."""
    if q.row_len is None and q.layout != "rows":
        return contract.unpack_codes(q.codes.reshape(-1), n, q.bits).clone()
    row_len = q.row_len or n
    return contract.unpack_rows(q.codes.reshape(-1, q.codes.shape[-1]), row_len, q.bits).reshape(-1)[:n].clone()


def block_ids(n: int, row_len: int | None, block_size: int) -> torch.Tensor:
    """The quantization block of each of n flat elements: blocks start at every row (format 3)."""
    i = torch.arange(n)
    if row_len is None:
        return i // block_size
    per_row = -(-row_len // block_size)
    return (i // row_len) * per_row + (i % row_len) // block_size


def decode(state: dict, n: int) -> dict:
    """One param's quantized moments, decoded flat fp32: r (as stored), s = sqrt(v), m, the codes, and each
    element's block (``blocks``)."""
    mq, vq = qstate.QState.from_dict(state["exp_avg"]), qstate.QState.from_dict(state["exp_avg_sq"])
    s = ops.dequantize_blockwise(vq.codes, vq.absmax, vq.qmap, vq.block_size, "none", bits=vq.bits, numel=n,
                                 row_len=vq.row_len)
    r = ops.dequantize_blockwise(mq.codes, mq.absmax, mq.qmap, mq.block_size, "none", bits=mq.bits, numel=n,
                                 row_len=mq.row_len)
    m = r * (s + mq.eps) if mq.is_ratio else r
    codes = [unpack(q, n) for q in (mq, vq)]
    return {"r": r, "s": s, "m": m, "codes": codes, "blocks": block_ids(n, vq.row_len, vq.block_size)}


def zeros_state(n: int) -> dict:
    z = torch.zeros(n)
    return {"r": z, "s": z, "m": z, "codes": None, "blocks": None}


def exact_step(prev: dict, p: torch.Tensor, g: torch.Tensor, group: dict, step: int, lr: float) -> dict:
    """The fp32 values the quantized kernel computed this step from its decoded state (``adam_math``):
    m, v, s = sqrt(v), the ratio it rounded and the update direction u it applied."""
    b1, b2 = group["betas"]
    h = adam.hyper_tensor(lr, b1, b2, group["eps"], group["weight_decay"], step, True)
    _, m, v, _ = backend_torch.adam_math(p.float(), g.float(), prev["m"], prev["s"] * prev["s"], None, h, False)
    s = backend_torch.ieee_sqrt(v)
    r = m / (s + policy.ratio_eps_for(group, step))
    return {"m": m, "v": v, "s": s, "r": r, "u": direction(m, v, group, step)}


def direction(m: torch.Tensor, v: torch.Tensor, group: dict, step: int) -> torch.Tensor:
    """Adam's update direction m_hat / (sqrt(v_hat) + eps), in float64."""
    b1, b2 = group["betas"]
    return (m.double() / (1 - b1**step)) / ((v.double() / (1 - b2**step)).sqrt() + group["eps"])


def shadow_step(sh: dict, g: torch.Tensor, group: dict, step: int) -> torch.Tensor:
    """torch AdamW's moments on the same gradient, in place; returns the shadow's update direction u*."""
    b1, b2 = group["betas"]
    sh["m"].lerp_(g, 1 - b1)
    sh["v"].mul_(b2).addcmul_(g, g, value=1 - b2)
    return direction(sh["m"], sh["v"], group, step)


def signed_sums(x: torch.Tensor, ref: torch.Tensor, name: str) -> dict:
    """Sums for a relative L2 error and a magnitude bias of x against ref (both flat)."""
    d = (x.double() - ref.double())
    return {f"{name}_dd": d.square().sum().item(), f"{name}_rr": ref.double().square().sum().item(),
            f"{name}_bias": (d * ref.sign()).sum().item(), f"{name}_abs": ref.double().abs().sum().item()}


def log_sums(x: torch.Tensor, ref: torch.Tensor, name: str) -> dict:
    """Sums for the geometric bias mean log(x / ref) over elements where both are positive, and the count
    of elements that collapsed to 0 while ref > 0."""
    ok = (x > 0) & (ref > 0)
    lr = (x[ok].double() / ref[ok].double()).log()
    zero = int(((x <= 0) & (ref > 0)).sum())
    return {f"{name}_log": lr.sum().item(), f"{name}_n": int(ok.sum()), f"{name}_zero": zero}


def decade_sums(s: torch.Tensor, s_ref: torch.Tensor, blocks: torch.Tensor) -> dict:
    """v's geometric bias by decade of v* below its block's largest v* (near-zero v, blocks over decades);
    ``blocks``: each element's block (``block_ids``)."""
    top = torch.zeros(int(blocks.max()) + 1).scatter_reduce(0, blocks, s_ref, "amax", include_self=False)[blocks]
    ok = (s > 0) & (s_ref > 0)
    dec = (2 * (top[ok] / s_ref[ok]).log10()).floor().clamp(0, DECADES - 1).long()  # decades of v = 2 x of s
    lr = (s[ok].double() / s_ref[ok].double()).log()
    out = {}
    for k in range(DECADES):
        sel = dec == k
        out[f"dec{k}_log"], out[f"dec{k}_n"] = lr[sel].sum().item(), int(sel.sum())
    return out


def stale_sums(prev: dict, new: dict, exact: dict) -> dict:
    """Elements whose exact value moved by > MOVED this step but whose code stayed (r and s), and the
    geometric error of the stale s values."""
    out = {}
    if prev["codes"] is None:
        return out
    for i, key in enumerate(("r", "s")):
        moved = (exact[key] - prev[key]).abs() > MOVED * prev[key].abs()
        same = moved & (new["codes"][i] == prev["codes"][i])
        out[f"stale_{key}"], out[f"moved_{key}"] = int(same.sum()), int(moved.sum())
    same_s = (new["codes"][1] == prev["codes"][1]) & ((exact["s"] - prev["s"]).abs() > MOVED * prev["s"].abs())
    out.update(log_sums(new["s"][same_s], exact["s"][same_s], "stale_s"))
    return out


def measure(prev: dict, new: dict, exact: dict, sh: dict, u_star: torch.Tensor) -> dict:
    """All sums of one tensor at one step (see the module docstring)."""
    out = signed_sums(exact["u"], u_star, "u")
    out["u_dot"] = ((exact["u"] - u_star) * u_star).sum().item()
    out.update(signed_sums(new["m"], sh["m"], "m"))
    out.update(log_sums(new["s"], sh["v"].sqrt(), "v"))
    out.update(signed_sums(new["s"].square(), sh["v"], "vl2"))
    out.update(signed_sums(new["r"], exact["r"], "r"))
    out.update(log_sums(new["s"], exact["s"], "s"))
    out.update(signed_sums(new["s"], exact["s"], "sl"))
    out.update(decade_sums(new["s"], sh["v"].sqrt(), new["blocks"]))
    out.update(stale_sums(prev, new, exact))
    return out


def check_param(p_new: torch.Tensor, p0: torch.Tensor, exact: dict, group: dict, step: int, lr: float) -> None:
    """The applied step must be the one ``exact_step`` reconstructs (else the measurement is of something else)."""
    b1, b2 = group["betas"]
    h = adam.hyper_tensor(lr, b1, b2, group["eps"], group["weight_decay"], step, True)
    denom = backend_torch.ieee_sqrt(exact["v"]) / h[7] + h[5]
    want = p0.float() * h[0] + h[6] * (exact["m"] / denom)
    err = (p_new.float() - want).norm() / max((want - p0).norm().item(), 1e-30)
    if err > 1e-3:
        raise SystemExit(f"step {step}: the applied update differs from the reconstructed one by {err:.2e}")


def train(args) -> list[dict]:
    """Train with the quantized optimizer; per step, the sums of ``measure`` for every quantized tensor."""
    cfg, _ = rf.model_config(args.size)
    data = rf.scratch_data(args, args.seed)
    torch.manual_seed(args.seed)
    model = mc.GPT(**cfg)
    opt = rf.scratch_optimizer(args.variant, model, args.lr, args.seed, args.betas)
    names = {id(p): n for n, p in model.named_parameters()}
    tracked = [(p, g) for g in opt.param_groups for p in g["params"] if opt._quantized(p)]
    shadows = {id(p): {"m": torch.zeros(p.numel()), "v": torch.zeros(p.numel())} for p, _ in tracked}
    base, schedule, records = [float(g["lr"]) for g in opt.param_groups], rf.warmup_schedule(args.warmup), []
    for t, (x, y) in enumerate(data, start=1):
        if schedule is not None:
            rf.set_lr(opt, base, schedule(t))
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = {id(p): (decode(opt.state[p], p.numel()) if opt.state[p] else zeros_state(p.numel()),
                          p.detach().reshape(-1).clone(), p.grad.reshape(-1).clone()) for p, _ in tracked}
        opt.step()
        rec = {}
        for p, group in tracked:
            prev, p0, g = before[id(p)]
            new, exact = decode(opt.state[p], p.numel()), exact_step(prev, p0, g, group, t, group["lr"])
            if t <= 3:
                check_param(p.detach().reshape(-1), p0, exact, group, t, group["lr"])
            u_star = shadow_step(shadows[id(p)], g, group, t)
            rec[names[id(p)]] = measure(prev, new, exact, shadows[id(p)], u_star)
        records.append({"step": t, "loss": loss.item(), "tensors": rec})
    return records


def pool(records: list[dict], lo: int, hi: int, tensor: str | None = None) -> dict:
    """The sums over steps lo..hi (inclusive) and all tensors (or one)."""
    total: dict = collections.Counter()
    for rec in records[lo - 1 : hi]:
        for name, sums in rec["tensors"].items():
            if tensor is None or name == tensor:
                total.update(sums)
    return total


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def metrics(s: dict) -> dict:
    """Pooled sums -> the reported figures (fractions; geometric biases as exp(mean log) - 1)."""
    geo = lambda k: math.exp(_ratio(s[f"{k}_log"], s[f"{k}_n"])) - 1 if s.get(f"{k}_n") else float("nan")  # noqa: E731
    return {
        "u_err": math.sqrt(_ratio(s["u_dd"], s["u_rr"])), "u_bias": _ratio(s["u_dot"], s["u_rr"]),
        "m_err": math.sqrt(_ratio(s["m_dd"], s["m_rr"])), "m_bias": _ratio(s["m_bias"], s["m_abs"]),
        "v_err": math.sqrt(_ratio(s["vl2_dd"], s["vl2_rr"])), "v_bias": geo("v"),
        "v_lin": _ratio(s["vl2_bias"], s["vl2_abs"]), "s_lin": _ratio(s["sl_bias"], s["sl_abs"]),
        "r_err": math.sqrt(_ratio(s["r_dd"], s["r_rr"])), "r_bias": _ratio(s["r_bias"], s["r_abs"]),
        "s_bias": geo("s"), "stale_r": _ratio(s.get("stale_r", 0), s.get("moved_r", 0)),
        "stale_s": _ratio(s.get("stale_s", 0), s.get("moved_s", 0)), "stale_s_bias": geo("stale_s"),
        "v_zero": _ratio(s["v_zero"], s["v_n"] + s["v_zero"]),
        **{f"dec{k}": geo(f"dec{k}") for k in range(DECADES)},
        **{f"dec{k}_share": _ratio(s[f"dec{k}_n"], sum(s[f"dec{j}_n"] for j in range(DECADES)))
           for k in range(DECADES)},
    }


COLUMNS = ("u_err", "u_bias", "m_err", "m_bias", "v_err", "v_lin", "v_bias", "r_err", "r_bias", "s_lin", "s_bias",
           "stale_r", "stale_s", "stale_s_bias")


def pct(x: float) -> str:
    return f"{100 * x:+.3f}%" if math.isfinite(x) else "-"


def by_step(records: list[dict], steps) -> str:
    """Pooled over all quantized tensors, at single steps."""
    rows = ["| step | loss | " + " | ".join(COLUMNS) + " |", "|---|---:|" + "---:|" * len(COLUMNS)]
    for t in [t for t in steps if t <= len(records)]:
        m = metrics(pool(records, t, t))
        rows.append(f"| {t} | {records[t - 1]['loss']:.4f} | " + " | ".join(pct(m[c]) for c in COLUMNS) + " |")
    return "\n".join(rows)


def by_window(records: list[dict], windows, tensors: list[str | None]) -> str:
    """Per tensor (None: all pooled) and window of steps; then v's bias by decade below the block's largest."""
    rows = ["| tensor | steps | " + " | ".join(COLUMNS) + " |", "|---|---|" + "---:|" * len(COLUMNS)]
    dec = ["| tensor | steps | " + " | ".join(f"v* 1e-{k}.. of block max" for k in range(DECADES)) + " |",
           "|---|---|" + "---:|" * DECADES]
    for name in tensors:
        for lo, hi in windows:
            m = metrics(pool(records, lo, hi, name))
            rows.append(f"| {name or 'all'} | {lo}-{hi} | " + " | ".join(pct(m[c]) for c in COLUMNS) + " |")
            dec.append(f"| {name or 'all'} | {lo}-{hi} | " + " | ".join(
                f"{pct(m[f'dec{k}'])} ({100 * m[f'dec{k}_share']:.1f}%)" for k in range(DECADES)) + " |")
    title = "v bias (geometric, sqrt domain) by decade of v* (share of elements):"
    return "\n".join(rows) + f"\n\n{title}\n\n" + "\n".join(dec)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="ckptq", help="ckptq (AdamW8bit), ckptq4 (AdamW4bit) or a registered one")
    parser.add_argument("--preset", choices=sorted(rf.PRESETS), help="resume_fidelity's preset (default: its own "
                        "from-scratch setting)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--betas", type=lambda x: tuple(float(b) for b in x.split(",")), default=mc.BETAS,
                        help="Adam's betas (default %(default)s, make_checkpoint's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--windows", help="comma list of lo-hi step windows (default 1-30,31-100,101-STEPS)")
    parser.add_argument("--per-tensor", action="store_true", help="also each tensor's rows")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the per-step, per-tensor sums here")
    args = parser.parse_args(argv)
    vars(args).update(size="mid", data="zipf", lr=mc.LEARNING_RATE, warmup=0)
    if args.preset:
        vars(args).update(rf.PRESETS[args.preset])
    spec = args.windows or f"1-30,31-100,101-{args.steps}"
    args.window_list = [tuple(int(x) for x in w.split("-")) for w in spec.split(",")]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    records = train(args)
    print(f"{args.variant}, {args.preset or 'default'} setting ({args.size}, {args.data}), betas {args.betas}, "
          f"seed {args.seed}, {args.steps} steps; all quantized tensors pooled:\n")
    print(by_step(records, SHOW_STEPS))
    tensors = [None] + (sorted(records[0]["tensors"]) if args.per_tensor else [])
    print("\n" + by_window(records, args.window_list, tensors))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "records": records}, f)


if __name__ == "__main__":
    main()
