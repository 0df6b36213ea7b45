"""bitsandbytes' and torchao's 8-bit Adam state, made by the real libraries on the CPU: info recognises
it, expand turns it into torch AdamW's fp32 state (the values those libraries decode to, exactly),
convert re-encodes it as ckptq's 8-bit state. torchao's optimizers step eagerly here (``eager_torchao``):
the same states as their compiled step, without its C++ compilation."""

import json
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from ckptq.codec import quant
import ckptq
from ckptq.cli import main


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def _train(opt_cls, n=8192 + 77, **kw):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(n)), torch.nn.Parameter(torch.randn(100))]
    opt = opt_cls(ps, lr=1e-2, **kw)
    for _ in range(3):
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()
    return ps, opt


def _bnb_dense(q: dict, i: int) -> torch.Tensor:
    import bitsandbytes.functional as F

    return F.dequantize_blockwise(q[f"state{i}"], absmax=q[f"absmax{i}"], code=q[f"qmap{i}"], blocksize=256)


@pytest.mark.parametrize("layout", ["nested", "flat"])  # bitsandbytes 0.50 nests its keys; releases before 0.45 did not
def test_bitsandbytes_state_expands_to_what_bitsandbytes_decodes(tmp_path, layout):
    bnb = pytest.importorskip("bitsandbytes")
    ps, opt = _train(bnb.optim.AdamW8bit)
    sd = opt.state_dict()
    q = sd["state"][0]["__bnb_optimizer_quant_state__"]
    want_m, want_v = _bnb_dense(q, 1), _bnb_dense(q, 2)
    if layout == "flat":
        for st in sd["state"].values():
            st.update(st.pop("__bnb_optimizer_quant_state__"))
    path = tmp_path / "optimizer.pt"
    torch.save(sd, path)
    assert json.loads(run("info", path, "--json").output)["details"]["foreign_8bit_params"] == 2
    assert run("expand", path, "-o", tmp_path / "fp32.pt").exit_code == 0
    out = torch.load(tmp_path / "fp32.pt", weights_only=True)
    assert torch.equal(out["state"][0]["exp_avg"], want_m) and torch.equal(out["state"][0]["exp_avg_sq"], want_v)
    assert torch.equal(out["state"][1]["exp_avg"], q_small(sd, 1))
    torch_opt = torch.optim.AdamW(ps, lr=1e-2)
    torch_opt.load_state_dict(out)  # a stock torch AdamW resumes from it
    torch_opt.step()


def q_small(sd: dict, pid: int) -> torch.Tensor:
    st = sd["state"][pid]
    return st.get("__bnb_optimizer_quant_state__", st)["state1"]


def test_bitsandbytes_state_converts_to_ckptq_state(tmp_path):
    bnb = pytest.importorskip("bitsandbytes")
    ps, opt = _train(bnb.optim.AdamW8bit)
    q = opt.state_dict()["state"][0]["__bnb_optimizer_quant_state__"]
    path = tmp_path / "optimizer.pt"
    torch.save(opt.state_dict(), path)
    report = ckptq.convert(str(path), str(tmp_path / "o.q8.safetensors"), min_size=1000)
    assert report.foreign_states == 2 and report.quantized == 2
    back = ckptq.load(str(tmp_path / "o.q8.safetensors"), dequantize=True)["state"][0]
    want = _bnb_dense(q, 2)
    assert float((back["exp_avg_sq"] - want).abs().max()) <= 0.02 * float(want.abs().max())


def test_torchao_state_needs_trust_then_expands(tmp_path, eager_torchao):
    ao = pytest.importorskip("torchao.optim")
    _, opt = _train(ao.AdamW8bit, n=8192)  # torchao quantizes only sizes divisible by its block (256)
    sd = opt.state_dict()
    want = sd["state"][0]["exp_avg_sq"].dequantize()
    path = tmp_path / "ao.pt"
    torch.save(sd, path)
    # a fresh process has not imported torchao, so torch.load(weights_only=True) refuses its classes
    r = subprocess.run([sys.executable, "-m", "ckptq", "expand", str(path), "-o", str(tmp_path / "fp32.pt")],
                       capture_output=True, text=True)
    assert r.returncode == 3 and "OptimState8bit" in r.stderr and not (tmp_path / "fp32.pt").exists()
    assert run("expand", path, "-o", tmp_path / "fp32.pt", "--trust").exit_code == 0
    out = torch.load(tmp_path / "fp32.pt", weights_only=True)
    assert type(out["state"][0]["exp_avg_sq"]) is torch.Tensor and torch.equal(out["state"][0]["exp_avg_sq"], want)
    report = ckptq.convert(str(path), str(tmp_path / "o.q8.safetensors"), trust=True, min_size=1000)
    assert report.foreign_states == 1 and report.quantized == 2


def test_adamw8bit_loads_bitsandbytes_state_directly():
    """AdamW8bit.load_state_dict takes a bitsandbytes AdamW8bit state dict as it is (the user's dict is not
    modified) and continues from the moments bitsandbytes decodes to."""
    bnb = pytest.importorskip("bitsandbytes")
    from ckptq.optim import AdamW8bit

    ps, opt = _train(bnb.optim.AdamW8bit)
    sd = opt.state_dict()
    q = sd["state"][0]["__bnb_optimizer_quant_state__"]
    ours = AdamW8bit(ps, lr=1e-2)
    ours.load_state_dict(sd)
    assert "__bnb_optimizer_quant_state__" in sd["state"][0]  # untouched
    v = quant.dequantize_state(ours.state[ps[0]]["exp_avg_sq"])
    want = _bnb_dense(q, 2)
    assert float((v - want).abs().max()) <= 0.02 * float(want.abs().max())
    assert float(ours.state[ps[0]]["step"]) == 3.0
    for p in ps:
        p.grad = torch.randn_like(p)
    ours.step()


def test_torchao_4bit_state_stays_4bit_without_bits(tmp_path, eager_torchao):
    """torchao's AdamW4bit state converted without --bits: 4-bit, the same size within headers (measured
    1.058x at 65,536 values, 1.004x at 2**20), where the old default of 8 bits grew it 1.93x; --bits 8 still
    asks for 8."""
    ao = pytest.importorskip("torchao.optim")
    _, opt = _train(ao.AdamW4bit, n=65536)
    path = tmp_path / "optimizer.pt"
    torch.save(opt.state_dict(), path)
    r = run("convert", path, "--trust", "--min-size", 1000, "--json")
    report = json.loads(r.output)
    assert r.exit_code == 0 and report["bits"] == 4 and report["outputs"] == [str(tmp_path / "optimizer.q4.safetensors")]
    assert report["output_bytes"] < 1.1 * report["source_bytes"]
    eight = ckptq.convert(str(path), trust=True, min_size=1000, bits=8)
    assert eight.bits == 8 and eight.outputs == [str(tmp_path / "optimizer.q8.safetensors")]
    assert eight.output_bytes > 1.8 * report["output_bytes"]
