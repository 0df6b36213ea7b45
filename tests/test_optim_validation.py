"""``load_state_dict`` checks every field of every parameter's state before anything changes (issue #21,
item 9): each spoiled field below used to load, then fail at the first step with a raw TypeError or
ctypes.ArgumentError, write NaN into the parameters, or make the C and PyTorch kernels disagree (a NaN
in a 4-bit exp_avg_sq codebook changed ~500 codes), or fail only at ``ckptq expand``."""

import copy

import pytest
import torch

from ckptq.errors import ArgumentError, StateMismatchError
from ckptq.optim import AdamW4bit, AdamW8bit, to_torch_state_dict

NAN, INF = float("nan"), float("inf")


def _trained(cls, amsgrad=False):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 128, generator=gen)), torch.nn.Parameter(torch.randn(5, generator=gen))]
    opt = cls(params, min_size=1024, amsgrad=amsgrad)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return opt, params


def _set(key, **fields):
    return lambda sd: sd["state"][0][key].update(fields)


def _poke(key, field, index, value):
    def spoil(sd):
        sd["state"][0][key][field][index] = value
    return spoil


def _retype(key, field, dtype):
    return lambda sd: sd["state"][0][key].update({field: sd["state"][0][key][field].to(dtype)})


SPOILED = {  # field -> (spoil the state dict, what the message says)
    "step NaN": (lambda sd: sd["state"][0].update(step=torch.tensor(NAN)), "'step' of parameter 0 is nan, not a finite count"),
    "step negative": (lambda sd: sd["state"][0].update(step=torch.tensor(-1.0)), "'step' of parameter 0 is -1.0, not a finite"),
    "step inf": (lambda sd: sd["state"][0].update(step=INF), "'step' of parameter 0 is inf, not a finite count"),
    "step beyond float": (lambda sd: sd["state"][0].update(step=10**400), "'step' of parameter 0 is inf, not a finite count"),
    "block_size float": (lambda sd: [sd["state"][0][k].update(block_size=256.0) for k in ("exp_avg", "exp_avg_sq")],
                         "'exp_avg' of parameter 0 is malformed: block_size 256.0 is not an int among 64, 128, 256"),
    "bits bool": (_set("exp_avg_sq", bits=True), "'exp_avg_sq' of parameter 0 is malformed: bits True is not an int among 8, 6, 4, 2"),
    "absmax float64": (_retype("exp_avg_sq", "absmax", torch.float64), "is malformed: absmax is torch.float64, where the kernels read float32"),
    "absmax NaN": (_poke("exp_avg_sq", "absmax", 3, NAN), "'exp_avg_sq' of parameter 0 is malformed: absmax holds 1 NaN or infinite scales"),
    "absmax inf": (_poke("exp_avg", "absmax", 0, INF), "'exp_avg' of parameter 0 is malformed: absmax holds 1 NaN or infinite scales"),
    "absmax negative": (_poke("exp_avg_sq", "absmax", 0, -1.0), "is malformed: absmax holds negative scales (min -1.0)"),
    "qmap NaN": (_poke("exp_avg_sq", "qmap", 5, NAN), "'exp_avg_sq' of parameter 0 is malformed: qmap holds NaN or infinite codes"),
    "qmap float64": (_retype("exp_avg", "qmap", torch.float64), "'exp_avg' of parameter 0 is malformed: qmap is torch.float64 ("),
    "qmap unsorted": (lambda sd: sd["state"][0]["exp_avg_sq"].update(qmap=sd["state"][0]["exp_avg_sq"]["qmap"].flip(0)),
                      "is malformed: qmap is not sorted ascending without repeats"),
    "dtype unknown": (_set("exp_avg_sq", dtype="nope"), "is malformed: dtype 'nope' is not the name of a floating-point dtype"),
    "dtype not a name": (_set("exp_avg", dtype=5), "is malformed: dtype 5 is not the name of a floating-point dtype"),
    "transform unknown": (_set("exp_avg_sq", transform="log"), "is malformed: transform 'log' is not one of none, sqrt, ratio"),
    "layout unknown": (_set("exp_avg_sq", layout="cols"), "is malformed: layout 'cols' is not one of"),
    "ratio eps NaN": (_set("exp_avg", eps=NAN), "'exp_avg' of parameter 0 is malformed: ratio eps nan is not a finite number >= 0"),
    "ratio eps inf": (_set("exp_avg", eps=INF), "is malformed: ratio eps inf is not a finite number >= 0"),
    "ratio eps negative": (_set("exp_avg", eps=-1e-8), "is malformed: ratio eps -1e-08 is not a finite number >= 0"),
    "shape of floats": (_set("exp_avg_sq", shape=(64.0, 128.0)), "is malformed: shape (64.0, 128.0) is not a sequence of ints >= 0"),
    "fp32 moment of ints": (lambda sd: sd["state"][1].update(exp_avg=sd["state"][1]["exp_avg"].long()),
                            "'exp_avg' of parameter 1 is a torch.int64 tensor, where Adam's moments are floating point"),
    "group eps inf": (lambda sd: sd["param_groups"][0].update(eps=INF), "param group 0 of the state dict: Invalid epsilon value: inf"),
}


@pytest.mark.parametrize("cls", [AdamW8bit, AdamW4bit])
@pytest.mark.parametrize("field", sorted(SPOILED))
def test_each_spoiled_field_is_refused_before_anything_changes(cls, field):
    spoil, match = SPOILED[field]
    opt, params = _trained(cls)
    before = copy.deepcopy(opt.state_dict())
    sd = copy.deepcopy(before)
    spoil(sd)
    with pytest.raises(StateMismatchError) as info:
        opt.load_state_dict(sd)
    message = str(info.value)
    assert match in message and "\n" not in message, message
    if not field.startswith("group"):
        assert "load an intact state dict (or delete state[" in message  # the fix
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for key in ("exp_avg", "exp_avg_sq"):
        for part in ("codes", "absmax", "qmap"):
            assert torch.equal(after["state"][0][key][part], before["state"][0][key][part])
    assert torch.equal(after["state"][1]["exp_avg"], before["state"][1]["exp_avg"])


def test_amsgrad_state_is_checked_too():
    opt, _ = _trained(AdamW8bit, amsgrad=True)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["max_exp_avg_sq"]["absmax"][0] = NAN
    with pytest.raises(StateMismatchError, match="'max_exp_avg_sq' of parameter 0 is malformed: absmax holds 1 NaN or infinite"):
        opt.load_state_dict(sd)


def test_intact_state_dicts_still_load_and_step_identically():
    for cls in (AdamW8bit, AdamW4bit):
        opt, params = _trained(cls)
        twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
        twin = cls(twin_params, min_size=1024)
        twin.load_state_dict(copy.deepcopy(opt.state_dict()))
        for p, q in zip(params, twin_params):
            p.grad = q.grad = torch.ones_like(p)
        opt.step(), twin.step()
        assert all(torch.equal(p, q) for p, q in zip(params, twin_params))


def test_decoding_for_torch_checks_the_fields_too():
    """``to_torch_state_dict`` / ``expand_on_load`` would have handed torch's AdamW NaN moments."""
    opt, _ = _trained(AdamW8bit)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["exp_avg_sq"]["absmax"][0] = NAN
    with pytest.raises(StateMismatchError, match="'exp_avg_sq' of parameter 0 is malformed: absmax holds 1 NaN or infinite"):
        to_torch_state_dict(sd)


def test_eps_inf_is_refused_where_torch_accepts_it():
    """torch's Adam(W) accepts eps=inf (every update 0, weight decay alone acts); in 8-bit state exp_avg is
    stored relative to sqrt(exp_avg_sq) + eps, which decodes to NaN: refused, at every door, saying why."""
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], eps=INF)  # accepted by torch
    with pytest.raises(ArgumentError, match=r"Invalid epsilon value: inf \(must be finite: torch.optim.Adam\(W\) accepts"):
        AdamW8bit([torch.nn.Parameter(torch.zeros(2))], eps=INF)
    opt = AdamW8bit([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ArgumentError, match="param group 1: Invalid epsilon value: inf"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "eps": INF})
