"""What convert stores 8-bit, decided once (ckptq.plan) for convert and info: Adam moments only, never a
finite value turned into NaN/Inf, clear errors for param groups no Adam could have saved, and torch.save
files that already hold ckptq 8-bit state (Trainer after an 8-bit resume) recognised by load/info/expand."""

import argparse
import json

import pytest
import torch
from click.testing import CliRunner

from ckptq.codec import codebooks, quant
import ckptq
from ckptq.cli import main
from ckptq.errors import InputError
from ckptq import info as ckptq_info
from ckptq.optim import AdamW8bit


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def _adamw_state(n=8192, steps=3, seed=0, **kw):
    torch.manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(n)), torch.nn.Parameter(torch.randn(n // 2))]
    opt = torch.optim.AdamW(ps, lr=1e-2, **kw)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()
    return opt.state_dict()


def _save(tmp_path, obj, name="ckpt.pt"):
    path = tmp_path / name
    torch.save(obj, path)
    return path


def _all_finite(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return bool(torch.isfinite(obj).all()) if obj.is_floating_point() else True
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return all(_all_finite(v) for v in values)


def test_negative_second_moment_is_kept_exact_and_nothing_becomes_nan(tmp_path):
    sd = _adamw_state()
    sd["state"][0]["exp_avg_sq"][5] = -1e-6
    path = _save(tmp_path, {"optimizer": sd})
    r = run("convert", path, "-o", tmp_path / "o.safetensors")
    assert r.exit_code == 0 and "state/0/exp_avg_sq: negative second moment" in r.output
    back = ckptq.load(str(tmp_path / "o.safetensors"), dequantize=True)["optimizer"]["state"]
    assert torch.equal(back[0]["exp_avg_sq"], sd["state"][0]["exp_avg_sq"])  # exact
    assert _all_finite(back)
    assert not torch.equal(back[1]["exp_avg"], sd["state"][1]["exp_avg"])  # the other param still 8-bit


def test_a_ratio_that_would_overflow_is_stored_on_its_own(tmp_path):
    sd = _adamw_state()
    sd["state"][0]["exp_avg"][7] = 1e31
    sd["state"][0]["exp_avg_sq"][7] = 0.0
    path = _save(tmp_path, {"optimizer": sd})
    report = ckptq.convert(str(path), str(tmp_path / "o.safetensors"))
    assert report.quantized == 4 and any("ratio to exp_avg_sq would not fit" in w for w in report.warnings)
    q = ckptq.load(str(tmp_path / "o.safetensors"))["optimizer"]["state"][0]["exp_avg"]
    assert q["transform"] == "none"
    back = ckptq.load(str(tmp_path / "o.safetensors"), dequantize=True)["optimizer"]["state"]
    assert _all_finite(back) and float(back[0]["exp_avg"][7]) == pytest.approx(1e31, rel=0.02)


@pytest.mark.parametrize("group,message", [
    ({"eps": float("nan")}, "eps nan"),
    ({"eps": "x"}, "eps 'x'"),
    ({"betas": (0.9, 1.5)}, r"betas \(0.9, 1.5\)"),
    ({"betas": "fast"}, "betas 'fast'"),
])
def test_param_groups_no_adam_could_have_saved_are_clear_errors(tmp_path, group, message):
    sd = _adamw_state()
    sd["param_groups"][0].update(group)
    path = _save(tmp_path, {"optimizer": sd})
    with pytest.raises(InputError, match=f"param group 0 has {message}"):
        ckptq.convert(str(path))
    r = run("convert", path)
    assert r.exit_code == 3 and len(r.output.strip().splitlines()) == 1
    assert not list(tmp_path.glob("*.safetensors"))


def test_a_group_without_params_and_meta_tensors_are_clear_errors(tmp_path):
    sd = _adamw_state()
    del sd["param_groups"][0]["params"]
    with pytest.raises(InputError, match="param group 0 has no 'params' list"):
        ckptq.convert(str(_save(tmp_path, {"optimizer": sd}, "a.pt")))
    sd = _adamw_state()
    sd["state"][0]["exp_avg"] = torch.empty(8192, device="meta")
    with pytest.raises(InputError, match="meta tensor"):
        ckptq_info(str(_save(tmp_path, {"optimizer": sd}, "b.pt")))


def test_each_optimizer_beside_another_is_stored_by_its_own_roles(tmp_path):
    """SGD's momentum next to AdamW: the AdamW moments are 8-bit as Adam's pair, the momentum 8-bit as a
    signed first moment (ckptq.codec.roles), on its own codebook."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8192))
    sgd = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.randn_like(p)
    sgd.step()
    path = _save(tmp_path, {"adamw": _adamw_state(), "sgd": sgd.state_dict()})
    report = ckptq.convert(str(path), str(tmp_path / "o.safetensors"))
    assert report.optimizers == 2 and report.quantized == 5
    back = ckptq.load(str(tmp_path / "o.safetensors"))
    buf = back["sgd"]["state"][0]["momentum_buffer"]
    assert buf["transform"] == "none" and buf["qmap"].tolist() == codebooks.power_map(True, 1.5).tolist()
    assert back["adamw"]["state"][0]["exp_avg"]["transform"] == "ratio"
    want = sgd.state_dict()["state"][0]["momentum_buffer"]
    assert float((quant.dequantize_state(buf) - want).norm() / want.norm()) < 0.01


def test_optimizers_with_nothing_to_store_low_bit_are_refused_plainly(tmp_path):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(128, 96))
    opt = torch.optim.Adafactor([p], lr=1e-2)
    p.grad = torch.randn_like(p)
    opt.step()
    path = _save(tmp_path, {"optimizer": opt.state_dict()})
    r = run("convert", path)
    assert r.exit_code == 3 and "holds no moments to store low-bit" in r.output and "row_var" in r.output
    assert "torch.optim.Adafactor" in r.output and "factored" in r.output
    info = json.loads(run("info", path, "--json").output)
    assert info["would_store"] == [] and info["would_write"] is None and "holds no moments" in info["notes"][0]
    # an optimizer ckptq does not recognise (no betas, eps a tuple): everything exact, no crash
    sd = _adamw_state()
    for g in sd["param_groups"]:
        g.pop("betas")
        g["eps"] = (1e-30, 1e-3)
    assert run("convert", _save(tmp_path, {"optimizer": sd}, "t.pt")).exit_code == 3


def test_info_predicts_exactly_what_convert_writes(tmp_path):
    sd = _adamw_state()
    path = _save(tmp_path, {"model": {"w": torch.randn(100)}, "optimizer": sd, "again": sd["state"][0]["exp_avg"]})
    info = ckptq_info(str(path))  # exp_avg of param 0 shares storage: kept exact by both
    report = ckptq.convert(str(path), str(tmp_path / "o.safetensors"))
    assert info.would_write == report.output_bytes and report.kept_shared == 1
    assert sum(r.tensors for r in info.would_store) == report.quantized == 3
    assert ckptq_info(report.outputs[0]).low_bit() == 3  # and the file holds what info said it would
    assert run("info", path, "--block-size", 100).exit_code == 2  # as convert refuses it
    info4 = json.loads(run("info", path, "--bits", 4, "--json").output)
    report4 = ckptq.convert(str(path), str(tmp_path / "o4.safetensors"), bits=4)
    assert info4["would_write"] == report4.output_bytes < report.output_bytes
    held = ckptq_info(str(tmp_path / "o4.safetensors"))  # what the file holds is what info said it would store
    assert sorted((r["role"], r["bits"], r["tensors"]) for r in info4["would_store"]) == \
        sorted((r.role, r.bits, r.tensors) for r in held.states if r.bits)
    assert {r["bits"] for r in info4["would_store"]} >= {6, 2}  # the ratio over the second moment it divides
    assert info4["options"]["block_size"] == 128 and "--bits 4 would write" in run("info", path, "--bits", 4).output
    assert held.options["block_size"] == 128
    r = run("info", path, "--bits", 3)
    assert r.exit_code == 2 and "bits" in r.output and "Traceback" not in r.output
    assert ckptq_info(str(path), key="optimizer").details["optimizers"] == "optimizer"


def test_objects_ckptq_cannot_store_do_not_suggest_trust(tmp_path):
    path = _save(tmp_path, {"args": argparse.Namespace(lr=1e-3), "optimizer": _adamw_state()})
    r = run("convert", path)
    assert r.exit_code == 3 and "argparse.Namespace" in r.output and "vars(args)" in r.output
    assert "pass --trust" not in r.output


def test_torch_save_file_holding_ckptq_state_loads_expands_and_resumes(tmp_path):
    """What Trainer writes as optimizer.pt after an 8-bit resume: torch.save(AdamW8bit.state_dict())."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(8192)), torch.nn.Parameter(torch.randn(10))]
    opt = AdamW8bit(ps, lr=1e-2)
    for _ in range(3):
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()
    path = _save(tmp_path, opt.state_dict(), "optimizer.pt")
    assert ckptq.load(str(path))["state"][0]["exp_avg"]["ckptq"] == "blockwise"
    dense = ckptq.load(str(path), dequantize=True)["state"][0]
    assert dense["exp_avg"].dtype == torch.float32 and dense["exp_avg"].shape == (8192,)
    assert json.loads(run("info", path, "--json").output)["details"]["low_bit_states"] == 2
    r = run("expand", path)
    assert r.exit_code == 0 and (tmp_path / "optimizer.fp32.pt").exists()
    sd = torch.load(tmp_path / "optimizer.fp32.pt", weights_only=True)
    assert torch.equal(sd["state"][0]["exp_avg"], dense["exp_avg"])
    torch_opt = torch.optim.AdamW(ps, lr=1e-2)
    torch_opt.load_state_dict(sd)
    torch_opt.step()  # resumes in fp32
    r = run("expand", tmp_path / "optimizer.fp32.pt", "-o", tmp_path / "again.pt")
    assert r.exit_code == 3 and "already expanded" in r.output


def test_the_optimizer_never_loads_finite_state_into_nan(recwarn):
    """AdamW8bit.load_state_dict of fp32 moments that 8 bits would damage: a negative second moment keeps
    that parameter's state fp32 (with a warning naming it); a ratio that would overflow stores the first
    moment on its own. Nothing finite comes back non-finite."""
    from ckptq.optim import AdamW8bit

    sd = _adamw_state()
    sd["state"][0]["exp_avg_sq"][5] = -1e-6
    sd["state"][1]["exp_avg"][7], sd["state"][1]["exp_avg_sq"][7] = 1e31, 0.0
    ps = [torch.nn.Parameter(torch.zeros(8192)), torch.nn.Parameter(torch.zeros(4096))]
    opt = AdamW8bit(ps, lr=1e-2)
    with pytest.warns(RuntimeWarning, match="state of parameter 0: exp_avg_sq negative second moment"):
        opt.load_state_dict(sd)
    assert torch.equal(opt.state[ps[0]]["exp_avg_sq"], sd["state"][0]["exp_avg_sq"])  # fp32, exact
    assert opt.state[ps[1]]["exp_avg"]["transform"] == "none"
    assert _all_finite(quant.dequantize_states(opt.state[ps[1]]))
