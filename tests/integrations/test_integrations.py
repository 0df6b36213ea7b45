"""What the framework integrations share, without any framework: imports stay lazy, the in-memory 8-bit
copy of an optimizer state dict leaves the live optimizer alone, ``low_bit_checkpoints`` round-trips through a
plain ``torch.save``, torchao's states move to ckptq's form and back exactly, and signposts stop a stock
load. The frameworks themselves: tests/integrations/test_integrations_{transformers,accelerate,lightning}.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import ckptq
from ckptq.codec import checkpoint, foreign
from ckptq.codec.qstate import is_qstate
from ckptq.codec.quant import count_qstates, dequantize_state
from ckptq.codec import signpost
from ckptq.integrations import _state
from ckptq.integrations.accelerate import low_bit_checkpoints
from ckptq.optim import AdamW8bit, to_torch_state_dict

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


def test_stored_low_bit_quantizes_a_copy_as_convert_does(tmp_path):
    opt = trained(torch.optim.AdamW)
    live = {k: v.clone() for k, v in opt.state[opt.param_groups[0]["params"][0]].items()}
    stored, count = _state.stored_low_bit(opt.state_dict())
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


def test_stored_low_bit_keeps_adamw8bit_state_as_it_is():
    sd = trained(AdamW8bit).state_dict()
    stored, count = _state.stored_low_bit(sd)
    assert count == 0 and stored["state"][0]["exp_avg"]["codes"] is sd["state"][0]["exp_avg"]["codes"]


@pytest.mark.parametrize("cls", [torch.optim.AdamW, AdamW8bit])
def test_low_bit_checkpoints_round_trips_through_torch_save(tmp_path, cls):
    opt = low_bit_checkpoints(trained(cls))
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    saved = torch.load(tmp_path / "opt.pt", weights_only=True)
    assert count_qstates(saved) == 2
    fresh = low_bit_checkpoints(trained(cls, steps=0))
    fresh.load_state_dict(saved)
    if cls is AdamW8bit:  # stored as it is
        assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"]["codes"], saved["state"][0]["exp_avg"]["codes"])
    else:  # fp32 moments again, equal to the 8-bit state decoded; saved as a signpost carrying it
        assert signpost.carries(saved)
        state = fresh.state[fresh.param_groups[0]["params"][0]]
        assert state["exp_avg"].dtype == torch.float32
        assert torch.equal(state["exp_avg_sq"], to_torch_state_dict(saved[signpost.CARRIED])["state"][0]["exp_avg_sq"])
        with pytest.raises(ValueError, match="b'ckptq: this optimizer state was saved low-bit"):
            torch.optim.AdamW(fresh.param_groups[0]["params"]).load_state_dict(saved)  # without low_bit_checkpoints


# torchao's AdamW8bit/AdamW4bit: their states move into ckptq's qstate form and back without a bit changed.

@pytest.fixture
def torchao_optim(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)  # torchao's step, eagerly: no C++ build here
    return pytest.importorskip("torchao.optim")


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit"])
def test_torchao_states_become_qstates_with_the_same_codes_and_back(torchao_optim, name):
    opt = trained(getattr(torchao_optim, name))
    for key in ("exp_avg", "exp_avg_sq"):
        live = opt.state[opt.param_groups[0]["params"][0]][key]  # 64 x 128: torchao's subclass
        q = foreign.torchao_qstate(live)
        assert q["bits"] == int(name[-4]) and q["block_size"] == live.block_size and q["transform"] == "none"
        assert torch.equal(dequantize_state(q), live.dequantize())  # ckptq decodes torchao's values exactly
        for back in (foreign.torchao_state(q), foreign.torchao_state(q, like=opt._new_buffer(live, key == "exp_avg"))):
            assert type(back) is type(live) and back.signed == live.signed and back.shape == live.shape
            assert torch.equal(back.codes, live.codes) and torch.equal(back.scale, live.scale)
    other = getattr(torchao_optim, "AdamW4bit" if name == "AdamW8bit" else "AdamW8bit")
    like = other(opt.param_groups[0]["params"])._new_buffer(live, False)
    assert foreign.torchao_state(q, like=like) is None  # another layout: for_optimizer requantizes instead


def test_stored_low_bit_stores_torchao_state_exactly_and_leaves_the_optimizer_alone(torchao_optim):
    opt = trained(torchao_optim.AdamW8bit)
    stored, count = _state.stored_low_bit(opt.state_dict())
    assert count == 2  # the weight's two moments; torchao keeps the bias' in fp32, below ckptq's min_size too
    assert is_qstate(stored["state"][0]["exp_avg"]) and isinstance(stored["state"][1]["exp_avg"], torch.Tensor)
    assert type(opt.state[opt.param_groups[0]["params"][0]]["exp_avg"]).__name__ == "OptimState8bit"
    fresh = trained(torchao_optim.AdamW8bit, steps=0)
    fresh.load_state_dict(_state.for_optimizer(fresh, stored))
    for p, q in zip(opt.param_groups[0]["params"], fresh.param_groups[0]["params"]):
        for key, value in opt.state[p].items():
            if hasattr(value, "codes"):
                assert type(fresh.state[q][key]) is type(value) and torch.equal(fresh.state[q][key].codes, value.codes)
            else:
                assert torch.equal(fresh.state[q][key], value)


def test_torchao_optimizer_takes_fp32_state_in_its_own_form(torchao_optim):
    """torchao's load_state_dict keeps fp32 tensors as fp32 for good; for_optimizer quantizes them into
    torchao's states, so that a checkpoint of torch's AdamW does not cost torchao its memory savings."""
    fp32 = _state.stored_low_bit(trained(torch.optim.AdamW).state_dict())[0]  # ckptq 8-bit, ratio exp_avg
    opt = trained(torchao_optim.AdamW4bit, steps=0)
    opt.load_state_dict(_state.for_optimizer(opt, fp32))
    state = opt.state[opt.param_groups[0]["params"][0]]
    assert type(state["exp_avg"]).__name__ == "OptimState4bit"
    want = to_torch_state_dict(fp32)["state"][0]["exp_avg"]
    assert (state["exp_avg"].dequantize() - want).abs().max() <= 0.2 * want.abs().max()  # 4-bit rounding


def test_torchao_state_without_an_exact_form_is_stored_as_the_framework_stores_it(torchao_optim):
    opt = trained(torchao_optim.AdamWFp8)
    sd = opt.state_dict()
    with pytest.warns(UserWarning, match="not OptimStateFp8"):
        stored, count = _state.stored_low_bit(sd)
    assert count == 0 and stored is sd


def test_storage_key_takes_tensor_subclasses(torchao_optim):
    opt = trained(torchao_optim.AdamW8bit)
    states = [v for s in opt.state.values() for v in s.values()]
    assert len({checkpoint.storage_key(t) for t in states}) == len(states)  # torchao's states share nothing


def test_a_signpost_stops_torch_adamw_with_its_message(tmp_path):
    opt = trained(torch.optim.AdamW)
    torch.save(signpost.make(opt.state_dict(), "ckptq: resume with X"), tmp_path / "optimizer.pt")
    assert signpost.is_signpost_file(str(tmp_path / "optimizer.pt"))  # read with torch.load(weights_only=True)
    with pytest.raises(ValueError, match=r"^could not convert string to float: b'ckptq: resume with X'$"):
        trained(torch.optim.AdamW, steps=0).load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True))
    fresh = trained(torch.optim.AdamW, steps=0).state_dict()  # no state yet: nothing to lose, nothing to stop
    assert signpost.make(fresh, "x")["state"] == {}


def test_unwrap_puts_lightning_states_back():
    real = trained(torch.optim.AdamW).state_dict()
    ckpt = {"optimizer_states": [signpost.make(real, "m"), {"state": {}, "param_groups": []}],
            signpost.LIGHTNING_STATES: [real, None], signpost.LIGHTNING_TORCHAO: []}
    assert signpost.unwrap(ckpt) == 1
    assert ckpt == {"optimizer_states": [real, {"state": {}, "param_groups": []}]}
    assert signpost.unwrap(ckpt) == 0
