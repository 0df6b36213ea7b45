"""ckptq.optim behaves like a torch.optim optimizer where users touch it: argument errors, torch's
implementation flags, deepcopy/pickle, load_state_dict (hooks, older dicts, bad groups, meta tensors),
complex parameters. The generic torch tests are in tests/optim/test_torch_optim_*.py."""

import copy
import pickle

import pytest
import torch

from ckptq.codec import qstate, quant
from ckptq.errors import ArgumentError, CkptqError, StateMismatchError, UsageError
from ckptq.optim import Adam8bit, AdamW8bit, expand_on_load, to_torch_state_dict


def _params(seed=0, shapes=((16, 8), (5,))):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _steps(opt, params, n=3, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        opt.step()


BAD_ARGS = [
    (dict(lr="fast"), "lr must be a number"),
    (dict(lr=-1.0), "Invalid learning rate: -1.0"),
    (dict(lr=torch.tensor([1e-3, 1e-3])), "Tensor lr must be 1-element"),
    (dict(betas=(0.9, 1.5)), "Invalid beta parameter at index 1: 1.5"),
    (dict(betas=(1.0, 0.0)), "Invalid beta parameter at index 0: 1.0"),
    (dict(betas=(0.9,)), "betas must be a pair"),
    (dict(eps="x"), "eps must be a number"),
    (dict(eps=-1e-8), "Invalid epsilon value"),
    (dict(weight_decay=-1), "Invalid weight_decay value: -1"),
    (dict(amsgrad="yes"), "amsgrad must be True or False"),
    (dict(foreach="yes"), "foreach must be None, True or False"),
    (dict(capturable="yes"), "capturable must be True or False"),
    (dict(differentiable=True), "differentiable=True is not supported"),
    (dict(block_size=100), "block_size 100 is not supported"),
    (dict(min_size=-1), "min_size must be a whole number"),
    (dict(backend="gpu"), "backend 'gpu' is not one of"),
]


@pytest.mark.parametrize("cls", [AdamW8bit, Adam8bit])
@pytest.mark.parametrize("kwargs,match", BAD_ARGS, ids=[m for _, m in BAD_ARGS])
def test_bad_arguments_raise_value_errors(cls, kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        cls(_params(), **kwargs)
    assert isinstance(info.value, ArgumentError) and isinstance(info.value, UsageError)
    assert info.value.exit_code == 2  # the CLI's mapping of usage errors is unchanged


@pytest.mark.parametrize(
    "group,match",
    [
        ({"betas": (0.9, 1.5)}, r"param group 1: Invalid beta parameter at index 1: 1\.5"),
        ({"eps": "x"}, "param group 1: eps must be a number"),
        ({"lr": "fast"}, "param group 1: lr must be a number"),
    ],
)
def test_bad_param_group_raises_before_anything_is_built(group, match):
    a, b = _params()
    with pytest.raises(ArgumentError, match=match):
        AdamW8bit([{"params": [a]}, {"params": [b], **group}])
    opt = AdamW8bit([a])
    with pytest.raises(ArgumentError, match=match):  # the same check in add_param_group
        opt.add_param_group({"params": [b], **group})
    assert len(opt.param_groups) == 1
    with pytest.raises(ArgumentError, match="has no 'params'"):
        opt.add_param_group({"lr": 0.1})


@pytest.mark.parametrize("flags", [dict(fused=True), dict(foreach=True), dict(fused=False, foreach=False),
                                   dict(capturable=False, differentiable=False), dict(capturable=True)])
def test_torch_flags_are_accepted_recorded_and_change_nothing(flags):
    plain_p, flag_p = _params(), _params()
    plain, flagged = AdamW8bit(plain_p, min_size=64), AdamW8bit(flag_p, min_size=64, **flags)
    _steps(plain, plain_p)
    _steps(flagged, flag_p)
    for a, b in zip(plain_p, flag_p):
        assert torch.equal(a, b)
    for key, value in flags.items():
        assert flagged.param_groups[0][key] is value  # recorded in the groups, as torch does
    assert {"foreach", "fused", "capturable", "differentiable"} <= set(plain.state_dict()["param_groups"][0])


def test_argument_error_is_a_ckptq_error():
    e = ArgumentError("x")
    assert isinstance(e, CkptqError) and isinstance(e, ValueError) and e.exit_code == UsageError.exit_code


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_keep_options_and_step_like_the_original(how):
    params = _params()
    opt = AdamW8bit(params, block_size=64, min_size=16, backend="torch")
    _steps(opt, params)
    clone = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    assert (clone.block_size, clone.min_size, clone.backend) == (64, 16, "torch")
    clone_params = clone.param_groups[0]["params"]
    _steps(opt, params, n=2, seed=7)
    _steps(clone, clone_params, n=2, seed=7)
    for a, b in zip(params, clone_params):
        assert torch.equal(a, b)
    assert opt.state[params[0]]["exp_avg"]["block_size"] == 64


def test_unpickling_an_older_object_fills_options_and_flags():
    params = _params()
    opt = Adam8bit(params, min_size=16)
    _steps(opt, params)
    old = {k: opt.__getstate__()[k] for k in ("defaults", "state", "param_groups")}  # what torch pickles
    for group in old["param_groups"]:
        del group["maximize"], group["fused"]
    restored = Adam8bit.__new__(Adam8bit)
    restored.__setstate__(old)
    assert (restored.block_size, restored.min_size, restored.backend) == (256, 4096, "auto")
    assert restored.param_groups[0]["maximize"] is False and restored.param_groups[0]["fused"] is None
    _steps(restored, params, n=1)


def _trained(cls=AdamW8bit, **kwargs):
    params = _params()
    opt = cls(params, min_size=16, **kwargs)
    _steps(opt, params)
    return opt, params


def test_load_state_dict_runs_torchs_hooks_in_order():
    opt, params = _trained()
    sd = opt.state_dict()
    fresh = AdamW8bit(params, min_size=16)
    seen = []

    def replace(o, state_dict):
        seen.append(("replace",))
        new = copy.deepcopy(state_dict)
        new["param_groups"][0]["lr"] = 0.5
        return new

    fresh.register_load_state_dict_pre_hook(lambda o, d: seen.append(("pre", d["param_groups"][0]["lr"], len(o.state))))
    fresh.register_load_state_dict_pre_hook(replace, prepend=True)
    fresh.register_load_state_dict_post_hook(
        lambda o: seen.append(("post", o.param_groups[0]["lr"], float(o.state[params[0]]["step"])))
    )
    fresh.load_state_dict(sd)
    assert seen == [("replace",), ("pre", 0.5, 0), ("post", 0.5, 3.0)]
    assert sd["param_groups"][0]["lr"] == 1e-3  # the caller's dict is unchanged


def test_older_state_dict_without_group_flags_loads_and_steps():
    opt, params = _trained(maximize=True, amsgrad=True)
    sd = opt.state_dict()
    for group in sd["param_groups"]:
        for flag in ("maximize", "amsgrad", "foreach", "fused", "capturable", "differentiable"):
            del group[flag]
    for state in sd["state"].values():
        del state["max_exp_avg_sq"]
    opt.load_state_dict(sd)
    group = opt.param_groups[0]
    assert group["maximize"] is False and group["amsgrad"] is False and group["fused"] is None
    _steps(opt, params, n=1)


def test_param_names_are_kept_when_the_state_dict_has_none():
    model = torch.nn.Linear(4, 3)
    opt = AdamW8bit(model.named_parameters(), min_size=1)
    unnamed = AdamW8bit(model.parameters(), min_size=1).state_dict()
    opt.load_state_dict(unnamed)
    assert opt.param_groups[0]["param_names"] == ["weight", "bias"]


def test_implementation_flags_stay_the_optimizers():
    p = torch.nn.Parameter(torch.randn(8, 8))
    ref = torch.optim.AdamW([p], fused=True)
    p.grad = torch.randn_like(p)
    ref.step()
    sd = ref.state_dict()
    sd["param_groups"][0]["capturable"] = True  # saved by a CUDA-graph run: the flag is this optimizer's
    opt = AdamW8bit([p])
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["capturable"] is False and opt.param_groups[0]["fused"] is None
    _steps(opt, [p], n=1)


BAD_GROUPS = [
    (lambda g: g.update(betas=(0.9, 1.5)), r"param group 0 of the state dict: Invalid beta parameter at index 1"),
    (lambda g: g.update(eps="x"), "param group 0 of the state dict: eps must be a number"),
    (lambda g: g.update(lr="fast"), "param group 0 of the state dict: lr must be a number"),
    (lambda g: g.pop("params"), "param group 0 of the state dict has no 'params'"),
    (lambda g: g.pop("lr"), "param group 0 of the state dict has no 'lr'"),
]


@pytest.mark.parametrize("cls", [AdamW8bit, Adam8bit])
@pytest.mark.parametrize("spoil,match", BAD_GROUPS, ids=[m for _, m in BAD_GROUPS])
def test_bad_groups_in_a_state_dict_raise_before_anything_changes(cls, spoil, match):
    opt, params = _trained(cls)
    before = copy.deepcopy(opt.state_dict())
    sd = opt.state_dict()
    spoil(sd["param_groups"][0])
    with pytest.raises(StateMismatchError, match=match) as info:
        opt.load_state_dict(sd)
    assert isinstance(info.value, ValueError)
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    assert torch.equal(after["state"][0]["exp_avg"]["codes"], before["state"][0]["exp_avg"]["codes"])


def test_meta_tensors_in_a_state_dict_are_refused_clearly():
    opt, params = _trained()
    sd = copy.deepcopy(opt.state_dict())  # state_dict() shares the live state, as torch's does
    sd["state"][1]["exp_avg"] = sd["state"][1]["exp_avg"].to("meta")
    with pytest.raises(StateMismatchError, match="state 'exp_avg' of parameter 1 is on the meta device"):
        opt.load_state_dict(sd)
    sd = copy.deepcopy(opt.state_dict())  # state_dict() shares the live state, as torch's does
    meta_codes = torch.empty(128, dtype=torch.uint8, device="meta")
    sd["state"][0]["exp_avg_sq"] = dict(sd["state"][0]["exp_avg_sq"], codes=meta_codes)
    with pytest.raises(StateMismatchError, match="'exp_avg_sq' of parameter 0 is on the meta device"):
        opt.load_state_dict(sd)
    sd = copy.deepcopy(opt.state_dict())  # state_dict() shares the live state, as torch's does
    sd["state"][0]["step"] = torch.tensor(3.0, device="meta")
    with pytest.raises(StateMismatchError, match="state 'step' of parameter 0 is a tensor"):
        opt.load_state_dict(sd)


def test_meta_parameters_cannot_take_state():
    with torch.device("meta"):
        model = torch.nn.Linear(4, 3)
    opt = AdamW8bit(model.parameters())
    with pytest.raises(StateMismatchError, match="meta device.*to_empty"):
        opt.load_state_dict(AdamW8bit(torch.nn.Linear(4, 3).parameters()).state_dict())


def test_unknown_parameter_ids_still_raise_but_other_keys_travel():
    opt, params = _trained()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][7] = sd["state"][0]
    with pytest.raises(StateMismatchError, match="parameter id 7"):
        opt.load_state_dict(sd)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"]["note"] = {"epoch": 3}
    opt.load_state_dict(sd)
    assert opt.state["note"] == {"epoch": 3} and opt.state_dict()["state"]["note"] == {"epoch": 3}


@pytest.mark.parametrize("cls", [AdamW8bit, Adam8bit])
@pytest.mark.parametrize("min_size", [1, 4096])
def test_complex_parameters_step_as_their_real_view(cls, min_size):
    gen = torch.Generator().manual_seed(0)
    c = torch.nn.Parameter(torch.randn(16, 8, dtype=torch.complex64, generator=gen))
    r = torch.nn.Parameter(torch.view_as_real(c.detach()).clone())
    opt_c, opt_r = cls([c], min_size=min_size), cls([r], min_size=min_size)
    for _ in range(3):
        g = torch.randn(16, 8, dtype=torch.complex64, generator=gen)
        c.grad, r.grad = g, torch.view_as_real(g).clone()
        opt_c.step()
        opt_r.step()
    assert torch.equal(torch.view_as_real(c.detach()), r.detach())  # the imaginary part moves too
    assert c.imag.abs().min() > 0
    state = opt_c.state[c]
    assert (quant.dequantize_states(state)["exp_avg"].shape if min_size == 1 else state["exp_avg"].shape) == (16, 8, 2)


def test_complex_state_round_trips_and_imports_from_torch():
    gen = torch.Generator().manual_seed(3)
    c = torch.nn.Parameter(torch.randn(32, 8, dtype=torch.complex64, generator=gen))
    ref = torch.optim.AdamW([c])
    c.grad = torch.randn(32, 8, dtype=torch.complex64, generator=gen)
    ref.step()  # torch keeps complex moments of c's shape
    opt = AdamW8bit([c], min_size=1)
    opt.load_state_dict(ref.state_dict())
    expect = quant.quantize_state(torch.view_as_real(ref.state[c]["exp_avg_sq"]), "exp_avg_sq", 256)
    assert torch.equal(opt.state[c]["exp_avg_sq"]["codes"], expect["codes"])  # as ckptq convert encodes it
    opt.step()
    again = AdamW8bit([c], min_size=1)
    again.load_state_dict(opt.state_dict())
    assert torch.equal(again.state[c]["exp_avg"]["codes"], opt.state[c]["exp_avg"]["codes"])
    again.step()


def test_grad_scaler_skips_steps_with_inf_grads_and_unscales_the_rest():
    params = _params()
    opt = AdamW8bit(params, min_size=16, lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = [p.detach().clone() for p in params]
    scaler.scale(sum((p * p).sum() for p in params)).backward()
    params[1].grad[0] = float("inf")
    scaler.step(opt)  # the generic path: ckptq has no fused grad_scale/found_inf step arguments
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(params, before)) and not opt.state
    assert scaler.get_scale() == 512.0
    opt.zero_grad()
    scaler.scale(sum((p * p).sum() for p in params)).backward()
    scaler.step(opt)
    torch.testing.assert_close(params[0].grad, 2 * before[0])  # unscaled before the step
    assert not torch.equal(params[0], before[0])


def test_a_torch_optimizer_resumes_from_8bit_state_after_expanding():
    params = _params()
    opt = AdamW8bit(params, min_size=16, amsgrad=True)
    _steps(opt, params)
    sd = opt.state_dict()
    dense = to_torch_state_dict(sd)
    assert qstate.is_qstate(sd["state"][0]["exp_avg"])  # the argument is unchanged
    for pid, state in dense["state"].items():
        expect = quant.dequantize_states(opt.state[params[pid]])
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert torch.equal(state[key], expect[key])
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref = torch.optim.AdamW(ref_params, amsgrad=True)
    expand_on_load(ref)
    ref.load_state_dict(sd)  # without the hook torch accepts it and fails at step: 'dict' has no 'lerp_'
    _steps(ref, ref_params, n=1, seed=5)
    _steps(opt, params, n=1, seed=5)
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b)  # the same moments: the steps agree to fp32 rounding


def test_expand_on_load_restores_complex_moments():
    c = torch.nn.Parameter(torch.randn(16, 8, dtype=torch.complex64))
    opt = AdamW8bit([c], min_size=1)
    _steps(opt, [c], n=2)
    ref = torch.optim.AdamW([torch.nn.Parameter(c.detach().clone())])
    expand_on_load(ref)
    ref.load_state_dict(opt.state_dict())
    moment = next(iter(ref.state.values()))["exp_avg"]
    assert moment.is_complex() and moment.shape == (16, 8)
    _steps(ref, ref.param_groups[0]["params"], n=1)


def test_step_refuses_meta_parameters_before_building_state():
    with torch.device("meta"):
        model = torch.nn.Linear(4, 3)
    opt = Adam8bit(model.parameters(), min_size=1)
    with torch.device("meta"):
        for p in model.parameters():
            p.grad = torch.rand_like(p)
    with pytest.raises(UsageError, match=r"parameter 0 of param group 0 \(shape \(3, 4\)\).*meta device"):
        opt.step()
    assert not opt.state  # nothing half-stepped, no meta state left behind
