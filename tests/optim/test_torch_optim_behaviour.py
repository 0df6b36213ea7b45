"""torch.optim behaviour that ``TestOptimRenewed`` does not pin down, checked for every bundled class as shipped
and with ``min_size=1``: copies (deepcopy, pickle) step as the original, non-contiguous parameters as
contiguous ones, a tensor lr (scheduled in place) as its float, param groups added later as groups given at
construction, constructor arguments as the same values in a param group, ``maximize`` as the negated
gradient, ``capturable=True`` (taken on the CPU) as False, sparse gradients refused before anything changes,
``step(closure)`` and ``zero_grad`` as torch's; and each class against the optimizer it stands in for
(torch's, lion-pytorch's Lion, bitsandbytes' AdEMAMix): its steps from the first, its state dict loading
(and going back).

Most comparisons are bit for bit: the same numbers through the same kernels must give the same bits.
"""

import copy
import functools
import inspect
import pickle

import pytest
import torch
from torch.nn import Parameter

from ckptq.errors import StateMismatchError, UsageError
from ckptq.optim import to_torch_state_dict
from tests.helpers.optim_conformance import (  # noqa: F401 (one_thread: a fixture)
    assert_bits, assert_same, configs, goes_right_direction, one_thread, optim_inputs, optims, problem,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]


def _step(opt, params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()


def _run_twins(a, b, steps=3, seed=0):
    """Step two (optimizer, params) pairs on the same gradients; same bits in parameters and state."""
    (opt_a, params_a), (opt_b, params_b) = a, b
    for i in range(steps):
        grads = _grads(params_a, seed + i)
        _step(opt_a, params_a, grads)
        _step(opt_b, params_b, grads)
    assert_bits([p.detach() for p in params_a], [p.detach() for p in params_b])
    assert_bits(opt_a.state_dict()["state"], opt_b.state_dict()["state"])


@optims(where=lambda i: i.bits == 4 and not i.quantized, steps=False)
def test_shipped_4bit_class_steps_as_its_8bit_class(info):
    """Below ``min_size`` a 4-bit class keeps fp32 state and steps as its 8-bit class, bit for bit, state dicts
    alike: the tests that step run the 4-bit classes with ``min_size=1`` only (``Info.stepped``)."""
    eight = next(c for c in info.optim_cls.__mro__ if c.__name__ == f"{info.family}8bit")
    for kwargs in optim_inputs(info):
        params = problem(info).params
        twins = [Parameter(p.detach().clone()) for p in params]
        opt, opt_8 = info.make(params, **kwargs), eight(twins, **kwargs)
        _run_twins((opt, params), (opt_8, twins), steps=5)
        assert_same(opt.state_dict()["param_groups"], opt_8.state_dict()["param_groups"])


@optims
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("when", ["fresh", "stepped"])
def test_copies_step_as_the_original(info, how, when):
    """torch's optimizers copy with their parameters (``copy.deepcopy((params, opt))``) and pickle; the copy
    keeps every option (bits, block size, min_size, backend, rounding, a class's own) and steps as the
    original would, bit for bit."""
    for kwargs in configs(info, 2 * (how == "pickle") + (when == "stepped"), 4):
        params = problem(info).params
        opt = info.make(params, **kwargs)
        if when == "stepped":
            for i in range(2):
                _step(opt, params, _grads(params, 100 + i))
        pair = copy.deepcopy((params, opt)) if how == "deepcopy" else pickle.loads(pickle.dumps((params, opt)))
        params_c, opt_c = pair
        assert type(opt_c) is type(opt)
        assert {k: getattr(opt_c, k) for k in opt._pickled()} == {k: getattr(opt, k) for k in opt._pickled()}
        assert all(p is q for p, q in zip(params_c, opt_c.param_groups[0]["params"]))
        _run_twins((opt, params), (opt_c, params_c))


@optims
@pytest.mark.parametrize("layout", ["strided", "transposed"])
def test_non_contiguous_params_step_as_contiguous_ones(info, layout):
    """torch steps non-contiguous parameters in place; so does ckptq (through a contiguous copy), with the
    bits of the same values held contiguously, from the first step on, and from what the parameter holds
    when it changes between steps."""
    for kwargs in configs(info, layout == "transposed", 2):
        if layout == "transposed":
            params = [Parameter(p.detach().t().contiguous().t()) if p.dim() == 2 else p for p in problem(info).params]
        else:
            params = problem(info, contiguous=False).params
        assert not params[0].is_contiguous()
        twins = [Parameter(p.detach().clone(memory_format=torch.contiguous_format)) for p in params]
        opts = info.make(params, **kwargs), info.make(twins, **kwargs)
        _run_twins((opts[0], params), (opts[1], twins))
        with torch.no_grad():
            for p in params + twins:
                p.mul_(0.5)
        _run_twins((opts[0], params), (opts[1], twins), seed=10)


@optims
def test_tensor_lr_scheduled_in_place_is_read_at_every_step(info):
    """torch's schedulers change a tensor lr in place (``fill_``); every step reads its value then."""
    for kwargs in configs(info):
        params = problem(info).params
        twins = [Parameter(p.detach().clone()) for p in params]
        opt = info.make(params, **{**kwargs, "lr": torch.tensor(0.01)})
        opt_f = info.make(twins, **{**kwargs, "lr": float(torch.tensor(0.01))})
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for i in range(4):
            grads = _grads(params, i)
            _step(opt, params, grads)
            _step(opt_f, twins, grads)
            sched.step()
            opt_f.param_groups[0]["lr"] = float(opt.param_groups[0]["lr"])
        assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
        assert_bits([p.detach() for p in params], [p.detach() for p in twins])


@optims
def test_constructor_arguments_act_as_param_group_values(info):
    """Every argument works in a param group as given to the constructor (Lion's decoupled_weight_decay too)."""
    for kwargs in configs(info):
        params = problem(info).params
        twins = [Parameter(p.detach().clone()) for p in params]
        by_group = info.make([{"params": twins, **kwargs}])
        _run_twins((info.make(params, **kwargs), params), (by_group, twins))


@optims
def test_param_group_added_later_steps_as_one_given_first(info):
    """``add_param_group`` after some steps: the new group steps as if it had been there, without
    gradients, from the start (and the old group's state carries on)."""
    for kwargs in configs(info):
        first, later = problem(info, seed=1).params, problem(info, seed=2).params[:1]
        first_c, later_c = [[Parameter(p.detach().clone()) for p in ps] for ps in (first, later)]
        opt = info.make(first, **kwargs)
        opt_c = info.make([{"params": first_c}, {"params": later_c, "lr": 0.01}], **kwargs)
        for i in range(2):
            grads = _grads(first, i)
            _step(opt, first, grads)
            _step(opt_c, first_c, grads)
        opt.add_param_group({"params": later, "lr": 0.01})
        _run_twins((opt, first + later), (opt_c, first_c + later_c), seed=10)


@optims(where=lambda i: "capturable" in i.defaults)
def test_capturable_steps_as_not_capturable(info):
    """torch refuses capturable=True on the CPU; ckptq takes it (one code path tested everywhere): the step's
    scalars come from the step tensors by tensor ops (``ckptq.optim.scalars``), with the host formulas' bits,
    here for two param groups (the config's, the defaults) whose members the kernels step together."""
    for kwargs in configs(info):
        params = problem(info).params
        twins = [Parameter(p.detach().clone()) for p in params]
        opts = [info.make([{"params": ps[:1], **kwargs}, {"params": ps[1:]}], capturable=capturable)
                for ps, capturable in ((params, True), (twins, False))]
        _run_twins((opts[0], params), (opts[1], twins), steps=4)


@optims(where=lambda i: "maximize" in i.defaults)
def test_maximize_steps_as_the_negated_gradient(info):
    """torch's maximize negates the gradient first (before weight decay): the same bits as -g minimized."""
    for kwargs in configs(info):
        kwargs.pop("maximize", None)
        params = problem(info).params
        twins = [Parameter(p.detach().clone()) for p in params]
        opt, opt_n = info.make(params, maximize=True, **kwargs), info.make(twins, **kwargs)
        for i in range(3):
            grads = _grads(params, i)
            _step(opt, params, grads)
            _step(opt_n, twins, [-g for g in grads])
        assert_bits([p.detach() for p in params], [p.detach() for p in twins])


@optims
def test_step_with_closure_returns_its_loss(info):
    """``step(closure)`` calls the closure once, with grad enabled, before stepping, and returns its value."""
    prob = problem(info)
    opt = info.make(prob.params)
    calls = []

    def closure():
        calls.append(torch.is_grad_enabled())
        opt.zero_grad()
        loss = prob.loss()
        loss.backward()
        return loss

    before = prob.weight.detach().clone()
    loss = opt.step(closure)
    assert calls == [True] and torch.is_tensor(loss) and loss.grad_fn is not None
    assert not torch.equal(prob.weight.detach(), before)
    assert opt.step() is None


@optims(steps=False)
def test_sparse_gradients_are_refused_before_anything_changes(info):
    """torch's SGD and Adagrad take sparse gradients (its test_rosenbrock_sparse); low-bit state is dense
    blocks, and every class refuses them (UsageError) before a step count or a state changes."""
    prob = problem(info)
    opt = info.make(prob.params)
    opt.step(prob.closure(opt))
    state, values = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in prob.params]
    prob.closure(opt)()
    prob.weight.grad = prob.weight.grad.to_sparse()
    with pytest.raises(UsageError, match="sparse"):
        opt.step()
    assert_bits(opt.state_dict(), state)
    assert_bits([p.detach() for p in prob.params], values)


@optims
def test_zero_grad(info):
    prob = problem(info)
    opt = info.make(prob.params)
    prob.loss().backward()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in prob.params)
    opt.zero_grad()
    assert all(p.grad is None for p in prob.params)


def _reference(info):
    """The optimizer the class stands in for: torch's, lion-pytorch's Lion, bitsandbytes' AdEMAMix (32-bit)."""
    if info.torch_info is not None:
        return getattr(torch.optim, info.family)
    if info.family == "Lion":
        return pytest.importorskip("lion_pytorch").Lion
    return functools.partial(pytest.importorskip("bitsandbytes").optim.AdEMAMix, optim_bits=32)


def _reference_configs(info, configs):
    """The configs the reference takes too (bitsandbytes' AdEMAMix has no ``maximize``)."""
    takes = inspect.signature(_reference(info)).parameters
    return [k for k in configs if set(k) <= set(takes)]


@optims(where=lambda i: not i.quantized)
def test_shipped_class_steps_as_its_reference(info):
    """Below ``min_size`` the state is fp32 and the class steps as the optimizer it stands in for, from the
    first step (torch's momentum buffer starts as the gradient, Adagrad's sum at its initial value...), to
    float rounding: every config, every step."""
    for kwargs in _reference_configs(info, optim_inputs(info)):
        prob = problem(info)
        prob_c = prob.clone()
        ref, opt = _reference(info)(prob.params, **kwargs), info.make(prob_c.params, **kwargs)
        for _ in range(6):
            ref.step(prob.closure(ref))
            opt.step(prob_c.closure(opt))
            assert_same(prob.params, prob_c.params, rtol=1e-5, atol=1e-6)


@optims()
def test_loads_reference_state_dict_and_goes_back(info):
    """The reference's state dict loads (fp32 state as it is below min_size, quantized as ``ckptq convert``
    does from it; bitsandbytes' decoded first); the run continues as the reference's (fp32 state: to float
    rounding; low-bit state: in the same direction), and ``to_torch_state_dict`` gives the reference a
    state it steps on (torch's and lion-pytorch's; bitsandbytes keeps its own keys)."""
    for kwargs in _reference_configs(info, configs(info)):
        prob = problem(info)
        ref = _reference(info)(prob.params, **kwargs)
        for _ in range(3):
            ref.step(prob.closure(ref))
        prob_c = prob.clone()
        opt = info.make(prob_c.params, **kwargs)
        opt.load_state_dict(copy.deepcopy(ref.state_dict()))
        for key, value in kwargs.items():  # as configured (lion-pytorch keeps decoupled_weight_decay apart)
            assert_same(opt.param_groups[0][key], value)
        initial = prob_c.loss().item()
        for _ in range(3):
            ref.step(prob.closure(ref))
            opt.step(prob_c.closure(opt))
        if info.quantized:
            assert goes_right_direction(kwargs, initial, prob_c.loss().item()), kwargs
        else:
            assert_same(prob.params, prob_c.params, rtol=1e-5, atol=1e-6)
        if info.family == "AdEMAMix":
            continue
        back = _reference(info)(prob_c.clone().params, **kwargs)
        back.load_state_dict(to_torch_state_dict(opt.state_dict(), back))
        assert set(back.state_dict()["state"]) == set(opt.state_dict()["state"])
        back.step(prob_c.closure(back))
