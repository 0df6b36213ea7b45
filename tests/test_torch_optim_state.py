"""PyTorch's generic optimizer tests, part 2 (see tests/test_torch_optim_conformance.py): hooks, state dicts,
deepcopy, named parameters and LR schedulers, against AdamW8bit and Adam8bit as shipped and with ``min_size=1``."""

import functools
import io
from copy import deepcopy

import pytest
import torch
from torch.nn import Parameter
from torch.optim.lr_scheduler import ReduceLROnPlateau, StepLR
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from optim_conformance import all_optim_inputs, assert_same, one_thread, optims, weight_bias  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


def _fwd_bwd(opt, w, b, x):
    opt.zero_grad()
    loss = (w.mv(x) + b).pow(2).sum()
    loss.backward()
    return loss


@optims
def test_step_pre_and_post_hooks(info):
    data = []
    opt = info.make([torch.tensor([1.0, 1.0])])
    handles = [opt.register_step_pre_hook(lambda o, a, k: data.append("pre"))]
    handles.append(opt.register_step_post_hook(lambda o, a, k: data.append("post")))
    opt.step()
    opt.step()
    assert data == ["pre", "post"] * 2
    for h in handles:
        h.remove()
    opt.step()
    assert data == ["pre", "post"] * 2


@optims
def test_step_all_hooks(info):
    data = []
    params = [torch.tensor([1.0, 1.0])]
    opt1, opt2 = info.make(params), torch.optim.SGD(params, lr=1e-3)
    handles = [
        register_optimizer_step_pre_hook(lambda o, a, k: data.append(0)),
        register_optimizer_step_post_hook(lambda o, a, k: data.append(5)),
    ]
    for opt in (opt1, opt2):
        handles.append(opt.register_step_pre_hook(lambda o, a, k: data.append(1)))
        handles.append(opt.register_step_post_hook(lambda o, a, k: data.append(2)))
    try:
        opt1.step()
        assert data == [0, 1, 2, 5]
        opt2.step()
        opt1.step()
        assert data == [0, 1, 2, 5] * 3
    finally:
        for h in handles:
            h.remove()
    opt1.step()
    assert data == [0, 1, 2, 5] * 3


def _pre_sd_hook(opt):
    opt.state["test"] = 1


def _post_sd_hook(opt, state_dict):
    state_dict["ran_state_dict_pre_hook"] = "test" in state_dict["state"]
    state_dict["state"].pop("test", None)
    return state_dict


@optims
@pytest.mark.parametrize("hooks", ["pre", "post", "pre_post"])
def test_state_dict_hooks(info, hooks):
    param = Parameter(torch.rand(2, 3))
    param.grad = torch.rand(2, 3)
    opt = info.make([param])
    if "pre" in hooks:
        opt.register_state_dict_pre_hook(_pre_sd_hook)
    if "post" in hooks:
        opt.register_state_dict_post_hook(_post_sd_hook)
    sd = opt.state_dict()
    if hooks == "pre":
        assert sd["state"]["test"] == 1
    else:
        assert sd["ran_state_dict_pre_hook"] is (hooks == "pre_post") and "test" not in sd["state"]


def _load_pre_hook1(opt, state_dict):
    state_dict["param_groups"][0]["lr"] = 0.002


def _load_pre_hook2(opt, state_dict):
    mine = deepcopy(state_dict)  # a hook may return a replacement, which must then be used
    mine["param_groups"][0]["lr"] = 0.003
    return mine


def _load_post_hook(opt):
    opt.state["ran_load_state_dict_pre_hook2"] = opt.param_groups[0]["lr"] == 0.003
    opt.state["ran_load_state_dict_post_hook"] = True


@optims
def test_load_state_dict_pre_hook_and_prepend(info):
    param = Parameter(torch.rand(2, 3))
    param.grad = torch.rand(2, 3)
    sd = info.make([param]).state_dict()
    opt2 = info.make([param])
    opt2.register_load_state_dict_pre_hook(_load_pre_hook1)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == 0.002
    opt2.register_load_state_dict_pre_hook(_load_pre_hook2, prepend=True)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == 0.002  # hook2 ran first, hook1 changed its replacement


@optims
@pytest.mark.parametrize("with_pre_hook", [False, True])
def test_load_state_dict_post_hook(info, with_pre_hook):
    param = Parameter(torch.rand(2, 3))
    param.grad = torch.rand(2, 3)
    opt = info.make([param])
    if with_pre_hook:
        opt.register_load_state_dict_pre_hook(_load_pre_hook2, prepend=True)
    opt.register_load_state_dict_post_hook(_load_post_hook)
    opt.load_state_dict(opt.state_dict())
    assert opt.state["ran_load_state_dict_pre_hook2"] is with_pre_hook
    assert opt.state["ran_load_state_dict_post_hook"] is True
    opt.step()
    opt.load_state_dict(opt.state_dict())  # non-parameter state keys travel as-is, as in torch


def _named(params, named: bool):
    return [(f"name{i}", p) for i, p in enumerate(params)] if named else params


def _without_names(state_dict):
    out = deepcopy(state_dict)
    for group in out["param_groups"]:
        group.pop("param_names", None)
    return out


@optims
@pytest.mark.parametrize("named0", [False, True])
@pytest.mark.parametrize("named1", [False, True])
def test_state_dict_deterministic(info, named0, named1):
    weight, bias, x = weight_bias(seed=3)
    for kwargs in all_optim_inputs(info):
        opt = info.make(_named([weight, bias], named0), **kwargs)
        closure = functools.partial(_fwd_bwd, opt, weight, bias, x)
        for _ in range(10):
            opt.step(closure)
        weight_c, bias_c = Parameter(weight.detach().clone()), Parameter(bias.detach().clone())
        opt_c = info.make(_named([weight_c, bias_c], named1), **kwargs)
        closure_c = functools.partial(_fwd_bwd, opt_c, weight_c, bias_c, x)
        opt_c.load_state_dict(deepcopy(opt.state_dict()))
        for _ in range(10):
            opt.step(closure)
            opt_c.step(closure_c)
            assert_same(weight.detach(), weight_c.detach())
            assert_same(bias.detach(), bias_c.detach())
        assert_same(_without_names(opt.state_dict()), _without_names(opt_c.state_dict()))
        opt_c.param_groups.extend(opt_c.param_groups)
        last = [_without_names(o.state_dict())["param_groups"][-1] for o in (opt, opt_c)]
        assert_same(*last)


def _conv_bn():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 2, 1, stride=2), torch.nn.BatchNorm2d(2, eps=1e-05, momentum=0.1))
    return model, torch.rand(1, 4, 16, 16)


def _train(opt, model, x, steps=3):
    for _ in range(steps):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()


@optims
def test_can_load_older_state_dict(info):
    for kwargs in all_optim_inputs(info):
        model, x = _conv_bn()
        opt = info.make(model.parameters(), **kwargs)
        _train(opt, model, x)
        old = deepcopy(opt.state_dict())
        for group in old["param_groups"]:
            for flag in ("maximize", "foreach", "fused", "differentiable", "capturable"):
                group.pop(flag, None)
        opt.load_state_dict(old)
        assert opt.param_groups[0]["maximize"] is False  # torch fills a missing flag with its default
        _train(opt, model, x, steps=1)


@optims
@pytest.mark.parametrize("named0", [False, True])
@pytest.mark.parametrize("named1", [False, True])
def test_can_load_from_to_named_state_dict(info, named0, named1):
    for kwargs in all_optim_inputs(info):
        model, x = _conv_bn()
        opt = info.make(model.named_parameters() if named0 else model.parameters(), **kwargs)
        _train(opt, model, x)
        opt2 = info.make(model.named_parameters() if named1 else model.parameters(), **kwargs)
        opt2.load_state_dict(deepcopy(opt.state_dict()))
        _train(opt2, model, x, steps=1)
        group = opt2.state_dict()["param_groups"][0]
        if named0 or named1:
            assert group["param_names"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
        else:
            assert "param_names" not in group


@optims
@pytest.mark.parametrize("named", [False, True])
def test_save_load_equality_with_weights_only(info, named):
    weight, bias, x = weight_bias(seed=4)
    for kwargs in all_optim_inputs(info):
        opt = info.make(_named([weight, bias], named), **kwargs)
        for _ in range(3):
            opt.step(functools.partial(_fwd_bwd, opt, weight, bias, x))
        sd = opt.state_dict()
        buf = io.BytesIO()
        torch.save(sd, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=True)
        assert_same(sd, loaded)
        opt.load_state_dict(loaded)
        assert_same(opt.state_dict(), sd)


def _stepped_three_times(info):
    """(params, optimizer) for each of the class's argument sets, after 3 steps on fixed random gradients."""
    params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
    for p in params:
        p.grad = torch.rand_like(p)
    for kwargs in all_optim_inputs(info):
        opt = info.make(params, **kwargs)
        for _ in range(3):
            opt.step()
        yield params, opt


@optims
def test_load_nontensor_step(info):
    for params, opt in _stepped_three_times(info):
        sd = deepcopy(opt.state_dict())
        for state in sd["state"].values():
            state["step"] = state["step"].item()
        opt.load_state_dict(sd)
        assert all(float(opt.state[p]["step"]) == 3 for p in params)
        opt.step()


@optims
def test_deepcopy_copies_all_public_attrs(info):
    for _, opt in _stepped_three_times(info):
        public = {k for k in opt.__dict__ if not k.startswith("_")}
        assert public == {k for k in deepcopy(opt).__dict__ if not k.startswith("_")}


@optims
@pytest.mark.parametrize("scheduler", ["StepLR", "ReduceLROnPlateau"])
def test_param_group_with_lrscheduler_goes_right_direction(info, scheduler):
    for kwargs in all_optim_inputs(info):
        weight, bias, x = weight_bias(seed=5)
        opt = info.make([{"params": [weight]}, {"params": [bias], "lr": 0.01}], **kwargs)
        sched = StepLR(opt, gamma=0.9, step_size=10) if scheduler == "StepLR" else ReduceLROnPlateau(opt)
        closure = functools.partial(_fwd_bwd, opt, weight, bias, x)
        initial = closure().item()
        for _ in range(20):
            loss = opt.step(closure)
            sched.step(loss.item()) if scheduler == "ReduceLROnPlateau" else sched.step()
        final = closure().item()
        assert (final > initial) if kwargs.get("maximize") else (final < initial), kwargs
