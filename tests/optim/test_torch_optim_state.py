"""PyTorch's generic optimizer tests, part 2 (see tests/optim/test_torch_optim_conformance.py): hooks, state dicts,
deepcopy and named parameters, against every bundled class as shipped and with ``min_size=1``."""

import io
from copy import deepcopy

import pytest
import torch
from torch.nn import Parameter
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from tests.helpers.optim_conformance import (  # noqa: F401 (one_thread: a fixture)
    all_optim_inputs, assert_same, configs, conv_bn, one_thread, optims, problem, small_params, vector_param,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@optims(steps=False)
def test_step_pre_and_post_hooks(info):
    for kwargs in all_optim_inputs(info):
        data = []
        opt = info.make([vector_param(info)], **kwargs)
        handles = [opt.register_step_pre_hook(lambda o, a, k: data.append("pre"))]
        handles.append(opt.register_step_post_hook(lambda o, a, k: data.append("post")))
        opt.step()
        opt.step()
        assert data == ["pre", "post"] * 2
        for h in handles:
            h.remove()
        opt.step()
        assert data == ["pre", "post"] * 2


@optims(steps=False)
def test_step_all_hooks(info):
    for kwargs in all_optim_inputs(info):
        data = []
        params = [vector_param(info)]
        opt1, opt2 = info.make(params, **kwargs), torch.optim.SGD(params, lr=1e-3)
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
        opt2.step()
        assert data == [0, 1, 2, 5] * 3


def _pre_sd_hook(opt):
    opt.state["test"] = 1


def _post_sd_hook(opt, state_dict):
    state_dict["ran_state_dict_pre_hook"] = "test" in state_dict["state"]
    state_dict["state"].pop("test", None)
    return state_dict


@optims(steps=False)
@pytest.mark.parametrize("hooks", ["pre", "post", "pre_post"])
def test_state_dict_hooks(info, hooks):
    for kwargs in all_optim_inputs(info):
        opt = info.make(small_params(info, n=1), **kwargs)
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


@optims(steps=False)
def test_load_state_dict_pre_hook_and_prepend(info):
    for kwargs in all_optim_inputs(info):
        opt = info.make(small_params(info, n=1), **kwargs)
        sd = opt.state_dict()
        opt.register_load_state_dict_pre_hook(_load_pre_hook1)
        opt.load_state_dict(sd)
        assert opt.param_groups[0]["lr"] == 0.002
        opt.register_load_state_dict_pre_hook(_load_pre_hook2, prepend=True)
        opt.load_state_dict(sd)
        assert opt.param_groups[0]["lr"] == 0.002  # hook2 ran first, hook1 changed its replacement


@optims(steps=False)
@pytest.mark.parametrize("with_pre_hook", [False, True])
def test_load_state_dict_post_hook(info, with_pre_hook):
    for kwargs in all_optim_inputs(info):
        param = Parameter(torch.rand(2, 3))
        param.grad = torch.rand(2, 3)
        opt = info.make([param], **kwargs)
        if with_pre_hook:
            opt.register_load_state_dict_pre_hook(_load_pre_hook2, prepend=True)
        opt.register_load_state_dict_post_hook(_load_post_hook)
        opt.load_state_dict(opt.state_dict())
        assert bool(opt.state["ran_load_state_dict_pre_hook2"]) is with_pre_hook  # (lr may be a tensor)
        assert opt.state["ran_load_state_dict_post_hook"] is True
    opt.step()
    opt.load_state_dict(opt.state_dict())  # beside parameter state, keys that are not parameters travel as-is
    assert opt.state["ran_load_state_dict_post_hook"] is True


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
    prob = problem(info, seed=3, shape=(2, 3))
    for kwargs in configs(info, 2 * named0 + named1, 4):
        opt = info.make(_named(prob.params, named0), **kwargs)
        for _ in range(10):
            opt.step(prob.closure(opt))
        prob_c = prob.clone()
        opt_c = info.make(_named(prob_c.params, named1), **kwargs)
        opt_c.load_state_dict(deepcopy(opt.state_dict()))
        for _ in range(10):
            opt.step(prob.closure(opt))
            opt_c.step(prob_c.closure(opt_c))
            assert_same(prob.params, prob_c.params)
        assert_same(_without_names(opt.state_dict()), _without_names(opt_c.state_dict()))
        opt_c.param_groups.extend(opt_c.param_groups)
        last = [_without_names(o.state_dict())["param_groups"][-1] for o in (opt, opt_c)]
        assert_same(*last)


def _train(opt, model, x, steps=3):
    for _ in range(steps):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()


@optims
def test_can_load_older_state_dict(info):
    for kwargs in configs(info):
        model, x = conv_bn(info)
        opt = info.make(model.parameters(), **kwargs)
        _train(opt, model, x)
        old = deepcopy(opt.state_dict())
        flags = info.torch_info.not_og_supported_flags if info.torch_info else ("maximize",)
        for group in old["param_groups"]:
            for flag in flags:
                group.pop(flag, None)
        opt.load_state_dict(old)
        if "maximize" in info.defaults:
            assert opt.param_groups[0]["maximize"] is False  # torch fills a missing flag with its default
        _train(opt, model, x, steps=1)


@optims
@pytest.mark.parametrize("named0", [False, True])
@pytest.mark.parametrize("named1", [False, True])
def test_can_load_from_to_named_state_dict(info, named0, named1):
    for kwargs in configs(info, 2 * named0 + named1, 4):
        model, x = conv_bn(info)
        opt = info.make(model.named_parameters() if named0 else model.parameters(), **kwargs)
        _train(opt, model, x)
        opt2 = info.make(model.named_parameters() if named1 else model.parameters(), **kwargs)
        opt2.load_state_dict(deepcopy(opt.state_dict()))
        _train(opt2, model, x, steps=1)
        group = opt2.state_dict()["param_groups"][0]
        if named0 or named1:
            assert group["param_names"] == [n for n, _ in model.named_parameters()]
        else:
            assert "param_names" not in group


@optims
@pytest.mark.parametrize("named", [False, True])
def test_save_load_equality_with_weights_only(info, named):
    prob = problem(info, seed=4, shape=(2, 3))
    for kwargs in configs(info, named, 2):
        opt = info.make(_named(prob.params, named), **kwargs)
        for _ in range(3):
            opt.step(prob.closure(opt))
        sd = opt.state_dict()
        buf = io.BytesIO()
        torch.save(sd, buf)
        for weights_only in (False, True):
            buf.seek(0)
            loaded = torch.load(buf, weights_only=weights_only)
            assert_same(sd, loaded)
        opt.load_state_dict(loaded)
        assert_same(opt.state_dict(), sd)


def _stepped_three_times(info):
    """(params, optimizer) for each of the class's argument sets, after 3 steps on fixed random gradients."""
    params = small_params(info)
    for p in params:
        p.grad = torch.rand_like(p)
    for kwargs in configs(info):
        opt = info.make(params, **kwargs)
        for _ in range(3):
            opt.step()
        yield params, opt


@optims
def test_load_nontensor_step(info):
    for params, opt in _stepped_three_times(info):
        sd = deepcopy(opt.state_dict())
        for state in sd["state"].values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].item()
        opt.load_state_dict(sd)
        assert all(float(opt.state[p]["step"]) == 3 for p in params if opt.state[p])
        opt.step()


@optims
def test_deepcopy_copies_all_public_attrs(info):
    for _, opt in _stepped_three_times(info):
        public = {k for k in opt.__dict__ if not k.startswith("_")}
        assert public == {k for k in deepcopy(opt).__dict__ if not k.startswith("_")}
