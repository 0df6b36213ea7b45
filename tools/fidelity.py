"""How well does 8-bit optimizer state preserve the Adam update? ckptq against bitsandbytes, per tensor.

For every Adam state with at least 4096 elements (bitsandbytes' ``min_8bit_size``) it quantizes
``exp_avg`` (m) and ``exp_avg_sq`` (v) both ways, block 256, and compares the update
``u = m_hat / (sqrt(v_hat) + eps)`` (bias-corrected with the state's step and its group's betas, eps
from the group) and each moment by relative L2 error ``||x_q - x|| / ||x||``. The quality that
matters after conversion is the update, not the moments (Li et al., NeurIPS 2023, zero-point problem).

ckptq side: ``ckptq.qstate.quantize_state`` / ``dequantize_state``, i.e. what ckptq writes.
bitsandbytes side: ``bitsandbytes.functional.quantize_blockwise(t, code, blocksize=256)`` with its
optimizers' maps: ``create_dynamic_map(signed=True)`` for m, ``signed=False`` for v, no transform.

    PYTHONPATH=. python tools/fidelity.py /tmp/small.pt [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import json
import statistics
from dataclasses import asdict, dataclass

import torch

from ckptq import qstate

MIN_NUMEL = 4096  # bitsandbytes keeps smaller tensors in fp32
BLOCK_SIZE = 256


@dataclass
class Row:
    """Errors for one parameter's state; ``*_ckptq`` / ``*_bnb`` are relative L2 errors."""

    param: int
    shape: tuple
    numel: int
    u_ckptq: float
    u_bnb: float
    m_ckptq: float
    m_bnb: float
    v_ckptq: float
    v_bnb: float
    bytes_ckptq: int
    bytes_bnb: int


def find_optimizer_state(obj):
    """The first dict (depth first) holding 'state' and 'param_groups', or None."""
    if isinstance(obj, dict):
        if "state" in obj and "param_groups" in obj:
            return obj
        children = obj.values()
    elif isinstance(obj, (list, tuple)):
        children = obj
    else:
        return None
    for child in children:
        found = find_optimizer_state(child)
        if found is not None:
            return found
    return None


def adam_update(m: torch.Tensor, v: torch.Tensor, step: float, betas, eps: float) -> torch.Tensor:
    """torch AdamW's update direction m_hat / (sqrt(v_hat) + eps), before the learning rate."""
    m_hat = m.double() / (1 - betas[0] ** step)
    v_hat = v.double() / (1 - betas[1] ** step)
    return m_hat / (v_hat.sqrt() + eps)


def rel_err(approx: torch.Tensor, exact: torch.Tensor) -> float:
    exact = exact.double()
    denom = exact.norm().item()
    diff = (approx.double() - exact).norm().item()
    return diff / denom if denom > 0 else (0.0 if diff == 0 else float("inf"))


def ckptq_states(opt: dict, block_size: int = BLOCK_SIZE) -> dict:
    """{param id: (m_q, v_q, bytes)} through the real pipeline: ``ckptq.convert`` of a checkpoint
    holding ``opt``, then ``ckptq.load`` (so it measures exactly what ckptq writes)."""
    import tempfile

    import ckptq

    with tempfile.TemporaryDirectory() as d:
        src, dst = os.path.join(d, "opt.pt"), os.path.join(d, "opt.q8.safetensors")
        torch.save({"optimizer": opt}, src)
        ckptq.convert(src, dst, block_size=block_size)
        dense = ckptq.load(dst, dequantize=True)["optimizer"]["state"]
        quant = ckptq.load(dst)["optimizer"]["state"]
    out = {}
    for pid, st in quant.items():
        m, v = st.get("exp_avg"), st.get("exp_avg_sq")
        if qstate.is_qstate(m) and qstate.is_qstate(v):
            out[pid] = (dense[pid]["exp_avg"], dense[pid]["exp_avg_sq"], qstate.state_nbytes(m) + qstate.state_nbytes(v))
    return out


def bnb_roundtrip(m: torch.Tensor, v: torch.Tensor):
    """(m_q, v_q, bytes) through bitsandbytes with its 8-bit optimizers' maps and block size."""
    import bitsandbytes.functional as bnbf

    out, nbytes = [], 0
    for t, signed in ((m, True), (v, False)):
        code = bnbf.create_dynamic_map(signed=signed)
        codes, qs = bnbf.quantize_blockwise(t.float().contiguous(), code=code, blocksize=BLOCK_SIZE)
        out.append(bnbf.dequantize_blockwise(codes, qs).view(t.shape))
        nbytes += codes.numel() * codes.element_size() + qs.absmax.numel() * 4
    return out[0], out[1], nbytes


def _group_of(opt: dict) -> dict:
    return {pid: g for g in opt["param_groups"] for pid in g["params"]}


def measure(opt: dict, min_numel: int = MIN_NUMEL) -> list[Row]:
    """One Row per Adam state pair with >= min_numel elements: ckptq (as converted) vs bitsandbytes."""
    groups = _group_of(opt)
    ours = ckptq_states(opt)
    rows = []
    for pid, st in opt["state"].items():
        m, v = st.get("exp_avg"), st.get("exp_avg_sq")
        if not isinstance(m, torch.Tensor) or not isinstance(v, torch.Tensor) or m.numel() < min_numel:
            continue
        g = groups[pid]
        step = float(st["step"])
        u = adam_update(m, v, step, g["betas"], g["eps"])
        if pid not in ours:
            continue
        mc, vc, bc = ours[pid]
        mb, vb, bb = bnb_roundtrip(m, v)
        uc, ub = adam_update(mc, vc, step, g["betas"], g["eps"]), adam_update(mb, vb, step, g["betas"], g["eps"])
        rows.append(
            Row(pid, tuple(m.shape), m.numel(), rel_err(uc, u), rel_err(ub, u), rel_err(mc, m), rel_err(mb, m),
                rel_err(vc, v), rel_err(vb, v), bc, bb)
        )
    return rows


def summarize(rows: list[Row]) -> dict:
    """Worst and median of each error column, and bytes per parameter for both moments together."""
    out = {"tensors": len(rows), "numel": sum(r.numel for r in rows)}
    for col in ("u_ckptq", "u_bnb", "m_ckptq", "m_bnb", "v_ckptq", "v_bnb"):
        vals = [getattr(r, col) for r in rows]
        out[f"worst_{col}"], out[f"median_{col}"] = max(vals), statistics.median(vals)
    out["bytes_per_param_ckptq"] = sum(r.bytes_ckptq for r in rows) / out["numel"]
    out["bytes_per_param_bnb"] = sum(r.bytes_bnb for r in rows) / out["numel"]
    out["tensors_ckptq_worse"] = sum(r.u_ckptq > r.u_bnb for r in rows)
    return out


def markdown(rows: list[Row], summary: dict, top: int = 10) -> str:
    """The ``top`` tensors by bitsandbytes' update error, then worst/median rows and bytes/param."""
    pct = lambda x: f"{100 * x:.3f}%"  # noqa: E731
    head = "| param | shape | numel | u ckptq | u bnb | m ckptq | m bnb | v ckptq | v bnb |"
    lines = [head, "|" + "---|" * 9]
    for r in sorted(rows, key=lambda r: r.u_bnb, reverse=True)[:top]:
        errs = " | ".join(pct(x) for x in (r.u_ckptq, r.u_bnb, r.m_ckptq, r.m_bnb, r.v_ckptq, r.v_bnb))
        lines.append(f"| {r.param} | {'x'.join(map(str, r.shape))} | {r.numel:,} | {errs} |")
    for kind in ("worst", "median"):
        errs = " | ".join(pct(summary[f"{kind}_{c}"]) for c in ("u_ckptq", "u_bnb", "m_ckptq", "m_bnb", "v_ckptq", "v_bnb"))
        lines.append(f"| **{kind}** | | | {errs} |")
    lines.append("")
    lines.append(
        f"{summary['tensors']} tensors, {summary['numel']:,} values; bytes/param (m+v): ckptq "
        f"{summary['bytes_per_param_ckptq']:.4f}, bnb {summary['bytes_per_param_bnb']:.4f}; "
        f"tensors where ckptq's update error exceeds bnb's: {summary['tensors_ckptq_worse']}"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--json", metavar="PATH", help="also write rows and summary as JSON here")
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()
    opt = find_optimizer_state(torch.load(args.checkpoint, map_location="cpu", weights_only=True))
    if opt is None:
        raise SystemExit(f"{args.checkpoint}: no optimizer state dict (a dict with 'state' and 'param_groups')")
    rows = measure(opt)
    summary = summarize(rows)
    print(markdown(rows, summary, args.top))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "rows": [asdict(r) for r in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
