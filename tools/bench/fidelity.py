"""How well does 8-bit or 4-bit optimizer state preserve the Adam update? ckptq against bitsandbytes
(8-bit) and torchao (4-bit), per tensor.

For every Adam state with at least 4096 elements (bitsandbytes' ``min_8bit_size``) it quantizes
``exp_avg`` (m) and ``exp_avg_sq`` (v) every way, and compares the update
``u = m_hat / (sqrt(v_hat) + eps)`` (bias-corrected with the state's step and its group's betas, eps
from the group) and each moment by relative L2 error ``||x_q - x|| / ||x||``. The quality that
matters after conversion is the update, not the moments (Li et al., NeurIPS 2023, zero-point problem).

ckptq side: ``ckptq.codec.quant.quantize_state`` / ``dequantize_state``, i.e. what ckptq writes.
bitsandbytes side: ``bitsandbytes.functional.quantize_blockwise(t, code, blocksize=256)`` with its
optimizers' maps: ``create_dynamic_map(signed=True)`` for m, ``signed=False`` for v, no transform.
4-bit: ckptq as ``convert(..., bits=4)`` writes it (block 128), against torchao's ``AdamW4bit`` state
through its own quantizer (``torchao.optim.subclass_4bit.OptimState4bit``: block 128, a 4-bit dynamic
map for m, a linear map without zero for v). torchao keeps tensors whose size is not a multiple of 128
in fp32; those rows show ``nan`` for it.

    PYTHONPATH=. python tools/bench/fidelity.py /tmp/small.pt [--json out.json] [--no-4bit]
"""

from __future__ import annotations

import argparse
import os
import json
import statistics
from dataclasses import asdict, dataclass


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--json", metavar="PATH", help="also write rows and summary as JSON here")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--no-4bit", dest="four_bit", action="store_false", help="8-bit columns only")
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help and usage errors answer here, before torch and ckptq load

import torch  # noqa: E402

from ckptq.codec import qstate  # noqa: E402

MIN_NUMEL = 4096  # bitsandbytes keeps smaller tensors in fp32
BLOCK_SIZE = 256
AO4_BLOCK = 128  # torchao's AdamW4bit block size


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
    u_ckptq4: float = float("nan")  # 4-bit: ckptq --bits 4 and torchao AdamW4bit
    u_ao4: float = float("nan")
    m_ckptq4: float = float("nan")
    m_ao4: float = float("nan")
    v_ckptq4: float = float("nan")
    v_ao4: float = float("nan")
    bytes_ckptq4: int = 0
    bytes_ao4: int = 0


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


def ckptq_states(opt: dict, block_size: int | None = None, bits: int = 8) -> dict:
    """{param id: (m_q, v_q, bytes)} through the real pipeline: ``ckptq.convert`` of a checkpoint
    holding ``opt``, then ``ckptq.load`` (so it measures exactly what ckptq writes)."""
    import tempfile

    import ckptq

    with tempfile.TemporaryDirectory() as d:
        src, dst = os.path.join(d, "opt.pt"), os.path.join(d, f"opt.q{bits}.safetensors")
        torch.save({"optimizer": opt}, src)
        ckptq.convert(src, dst, block_size=block_size, bits=bits)
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


def ao4_roundtrip(m: torch.Tensor, v: torch.Tensor):
    """(m_q, v_q, bytes) through torchao's 4-bit optimizer state (its own quantizer); None where torchao
    keeps the state in fp32 (numel not a multiple of its block)."""
    from torchao.optim.subclass_4bit import OptimState4bit

    if m.numel() % AO4_BLOCK:
        return None
    out, nbytes = [], 0
    for t, signed in ((m, True), (v, False)):
        q = OptimState4bit.zeros(t.shape, signed, AO4_BLOCK)
        q.copy_(t.float())
        out.append(q.dequantize())
        nbytes += q.codes.numel() + 4 * q.scale.numel()
    return out[0], out[1], nbytes


def _four_bit(row: "Row", m, v, u, step, g, ours4: tuple) -> None:
    """Fill row's 4-bit columns: ckptq as converted at 4 bits, torchao's AdamW4bit state."""
    mc, vc, bc = ours4
    row.u_ckptq4 = rel_err(adam_update(mc, vc, step, g["betas"], g["eps"]), u)
    row.m_ckptq4, row.v_ckptq4, row.bytes_ckptq4 = rel_err(mc, m), rel_err(vc, v), bc
    ao = ao4_roundtrip(m, v)
    if ao is not None:
        ma, va, row.bytes_ao4 = ao
        row.u_ao4 = rel_err(adam_update(ma, va, step, g["betas"], g["eps"]), u)
        row.m_ao4, row.v_ao4 = rel_err(ma, m), rel_err(va, v)


def _group_of(opt: dict) -> dict:
    return {pid: g for g in opt["param_groups"] for pid in g["params"]}


def measure(opt: dict, min_numel: int = MIN_NUMEL, four_bit: bool = True) -> list[Row]:
    """One Row per Adam state pair with >= min_numel elements: ckptq (as converted) vs bitsandbytes, and
    with ``four_bit`` ckptq at 4 bits vs torchao's 4-bit state."""
    groups = _group_of(opt)
    ours = ckptq_states(opt, BLOCK_SIZE)
    ours4 = ckptq_states(opt, bits=4) if four_bit else {}
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
        row = Row(pid, tuple(m.shape), m.numel(), rel_err(uc, u), rel_err(ub, u), rel_err(mc, m), rel_err(mb, m),
                  rel_err(vc, v), rel_err(vb, v), bc, bb)
        if pid in ours4:
            _four_bit(row, m, v, u, step, g, ours4[pid])
        rows.append(row)
    return rows


COLUMNS_4BIT = ("u_ckptq4", "u_ao4", "m_ckptq4", "m_ao4", "v_ckptq4", "v_ao4")


def summarize(rows: list[Row]) -> dict:
    """Worst and median of each error column, and bytes per parameter for both moments together."""
    out = {"tensors": len(rows), "numel": sum(r.numel for r in rows)}
    for col in ("u_ckptq", "u_bnb", "m_ckptq", "m_bnb", "v_ckptq", "v_bnb"):
        vals = [getattr(r, col) for r in rows]
        out[f"worst_{col}"], out[f"median_{col}"] = max(vals), statistics.median(vals)
    out["bytes_per_param_ckptq"] = sum(r.bytes_ckptq for r in rows) / out["numel"]
    out["bytes_per_param_bnb"] = sum(r.bytes_bnb for r in rows) / out["numel"]
    out["tensors_ckptq_worse"] = sum(r.u_ckptq > r.u_bnb for r in rows)
    if all(r.bytes_ckptq4 for r in rows):
        ao = [r for r in rows if r.bytes_ao4]
        for col in COLUMNS_4BIT:
            vals = [getattr(r, col) for r in (ao if col.endswith("ao4") else rows)]
            out[f"worst_{col}"] = max(vals) if vals else float("nan")
            out[f"median_{col}"] = statistics.median(vals) if vals else float("nan")
        out["bytes_per_param_ckptq4"] = sum(r.bytes_ckptq4 for r in rows) / out["numel"]
        out["bytes_per_param_ao4"] = sum(r.bytes_ao4 for r in ao) / max(sum(r.numel for r in ao), 1)
        out["tensors_ao4"] = len(ao)
        out["tensors_ckptq4_worse_than_ao4"] = sum(r.u_ckptq4 > r.u_ao4 for r in ao)
        out["tensors_ckptq4_worse_than_bnb8"] = sum(r.u_ckptq4 > r.u_bnb for r in rows)
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
    if "worst_u_ckptq4" in summary:
        lines += ["", markdown_4bit(rows, summary, top)]
    return "\n".join(lines)


def markdown_4bit(rows: list[Row], summary: dict, top: int = 10) -> str:
    """4-bit: ckptq --bits 4 vs torchao AdamW4bit (and bitsandbytes 8-bit's update error beside them)."""
    pct = lambda x: f"{100 * x:.3f}%"  # noqa: E731
    cols = ("u_ckptq4", "u_ao4", "u_bnb", "m_ckptq4", "m_ao4", "v_ckptq4", "v_ao4")
    lines = ["| param | shape | u ckptq 4-bit | u torchao 4-bit | u bnb 8-bit | m ckptq4 | m ao4 | v ckptq4 | v ao4 |",
             "|" + "---|" * 9]
    for r in sorted(rows, key=lambda r: r.u_ckptq4, reverse=True)[:top]:
        lines.append(f"| {r.param} | {'x'.join(map(str, r.shape))} | " + " | ".join(pct(getattr(r, c)) for c in cols) + " |")
    for kind in ("worst", "median"):
        lines.append(f"| **{kind}** | | " + " | ".join(pct(summary[f"{kind}_{c}"]) for c in cols) + " |")
    lines += ["", f"bytes/param (m+v): ckptq 4-bit {summary['bytes_per_param_ckptq4']:.4f}, torchao 4-bit "
              f"{summary['bytes_per_param_ao4']:.4f} (on its {summary['tensors_ao4']} quantized tensors); tensors where "
              f"ckptq 4-bit's update error exceeds torchao 4-bit's: {summary['tensors_ckptq4_worse_than_ao4']}, "
              f"bnb 8-bit's: {summary['tensors_ckptq4_worse_than_bnb8']}"]
    return "\n".join(lines)


def main() -> None:
    args = build_parser().parse_args()
    opt = find_optimizer_state(torch.load(args.checkpoint, map_location="cpu", weights_only=True))
    if opt is None:
        raise SystemExit(f"{args.checkpoint}: no optimizer state dict (a dict with 'state' and 'param_groups')")
    rows = measure(opt, four_bit=args.four_bit)
    summary = summarize(rows)
    print(markdown(rows, summary, args.top))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "rows": [asdict(r) for r in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
