"""What the framework integrations share, without any framework: imports stay lazy, the in-memory 8-bit
copy of an optimizer state dict leaves the live optimizer alone, and ``store_8bit`` round-trips through
a plain ``torch.save``. The frameworks themselves: tests/test_integrations_{transformers,accelerate,lightning}.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import ckptq
from ckptq.integrations import _state
from ckptq.integrations.accelerate import store_8bit
from ckptq.optim import AdamW8bit, to_torch_state_dict
from ckptq.codec.qstate import is_qstate
from ckptq.codec.quant import count_qstates

FRAMEWORKS = ("transformers", "accelerate", "lightning", "pytorch_lightning")


def test_importing_ckptq_integrations_imports_no_framework():
    code = ("import sys, ckptq, ckptq.integrations, ckptq.integrations.accelerate; "
            f"print(sorted(m for m in {FRAMEWORKS!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def trained(cls, steps: int = 3) -> torch.optim.Optimizer:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 128)), torch.nn.Parameter(torch.randn(128))]
    opt = cls(params, lr=1e-2)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    return opt


def test_stored_8bit_quantizes_a_copy_as_convert_does(tmp_path):
    opt = trained(torch.optim.AdamW)
    live = {k: v.clone() for k, v in opt.state[opt.param_groups[0]["params"][0]].items()}
    stored, count = _state.stored_8bit(opt.state_dict())
    assert count == 2  # the 64x128 weight's two moments; the 128-element bias stays fp32 (below min_size)
    assert is_qstate(stored["state"][0]["exp_avg"]) and is_qstate(stored["state"][0]["exp_avg_sq"])
    assert isinstance(stored["state"][1]["exp_avg"], torch.Tensor)
    after = opt.state[opt.param_groups[0]["params"][0]]
    assert all(isinstance(after[k], torch.Tensor) and torch.equal(after[k], v) for k, v in live.items())
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    ckptq.convert(str(tmp_path / "opt.pt"))  # the file convert writes holds the same codes
    converted = ckptq.load(str(tmp_path / "opt.q8.safetensors"))
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(converted["state"][0][key]["codes"], stored["state"][0][key]["codes"])


def test_stored_8bit_keeps_adamw8bit_state_as_it_is():
    sd = trained(AdamW8bit).state_dict()
    stored, count = _state.stored_8bit(sd)
    assert count == 0 and stored["state"][0]["exp_avg"]["codes"] is sd["state"][0]["exp_avg"]["codes"]


@pytest.mark.parametrize("cls", [torch.optim.AdamW, AdamW8bit])
def test_store_8bit_round_trips_through_torch_save(tmp_path, cls):
    opt = store_8bit(trained(cls))
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    saved = torch.load(tmp_path / "opt.pt", weights_only=True)
    assert count_qstates(saved) == 2
    fresh = store_8bit(trained(cls, steps=0))
    fresh.load_state_dict(saved)
    if cls is AdamW8bit:  # stored as it is
        assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"]["codes"], saved["state"][0]["exp_avg"]["codes"])
    else:  # fp32 moments again, equal to the 8-bit state decoded
        state = fresh.state[fresh.param_groups[0]["params"][0]]
        assert state["exp_avg"].dtype == torch.float32
        assert torch.equal(state["exp_avg_sq"], to_torch_state_dict(saved)["state"][0]["exp_avg_sq"])
