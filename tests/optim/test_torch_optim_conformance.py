"""PyTorch's generic optimizer tests (``TestOptimRenewed`` in pytorch's ``test/test_optim.py``, CPU) against
every class ckptq bundles, as shipped and with ``min_size=1``, on torch's own inputs (tests/helpers/optim_conformance.py
says where they come from and what is left out). Written from torch's tests, checking the same behaviour;
hooks and state dicts are in tests/optim/test_torch_optim_state.py, copies, torch's state dicts and the rest of
torch's documented behaviour in tests/optim/test_torch_optim_behaviour.py.

Not here, and why:
- CUDA-only tests and those torch itself skips on the CPU (``test_fused_large_tensor``: 64 GB,
  ``test_cpu_load_state_dict``, ``test_state_dict_with_cuda_params``, ``test_mixed_device_dtype``,
  ``test_peak_memory_foreach``, ``test_foreach_large_tensor``, ``test_set_default_dtype_works_with_foreach``,
  ``test_forloop_goes_right_direction_multigpu``, ``test_defaults_changed_to_foreach``,
  ``test_fused_cpu_matches_cuda``, ``test_fused_does_not_step_if_foundinf``): no GPU in CI; the Triton path
  is tested in tests/kernels/test_step*.py. The last one passes ``grad_scale``/``found_inf`` to torch's fused
  kernels, which ckptq does not have; ``GradScaler``'s generic path is tested in tests/optim/test_optim_api.py.
- Tests for features these optimizers do not have: sparse gradients (``test_rosenbrock_sparse``, torch's
  SGD and Adagrad: every class refuses them with UsageError, tests/optim/test_torch_optim_behaviour.py), closures
  that must be called (``test_second_order_optims_return_consistent_types``: LBFGS only),
  ``differentiable=True`` (refused).
- As torch's ``@optims`` filters: the foreach/fused tests run for the classes whose constructor takes the
  flag (not Muon, Lion, AdEMAMix; RMSprop, NAdam and RAdam take no ``fused``, as torch's), the complex tests
  for the classes that step complex parameters (not Muon, as torch's).
"""

import inspect

import pytest
import torch
from torch.nn import Parameter

from ckptq.errors import UsageError
from tests.helpers.optim_conformance import (  # noqa: F401 (one_thread: a fixture)
    INFOS, UNSUPPORTED_ERRORS, UNSUPPORTED_KEYS, all_optim_inputs, assert_bits, assert_same, check_error,
    config_indices, configs, dropped_inputs, error_inputs, goes_right_direction, one_thread, optim_inputs, optims,
    paired, problem, shared, small_params, step_schedulers, unsupported_error_inputs,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_optim_infos_do_not_specify_global_cliquey_kwargs():
    for info in INFOS:
        for kwargs in optim_inputs(info):
            assert not {"foreach", "fused", "differentiable"} & set(kwargs), info.name


def test_every_dropped_torch_input_is_explained():
    for info in INFOS:
        for kwargs in dropped_inputs(info):
            assert set(kwargs) - set(info.defaults) <= set(UNSUPPORTED_KEYS), (info.name, kwargs)


@optims(where=lambda i: i.torch_info is not None, steps=False)
def test_takes_torchs_arguments_and_defaults(info):
    """Every argument of the torch class, by name, at torch's default; the same defaults in param groups."""
    params = [Parameter(torch.zeros(2, 2))]
    signature = inspect.signature(info.torch_info.optim_cls).parameters
    info.make(params, **{n: p.default for n, p in signature.items() if p.default is not inspect.Parameter.empty})
    ref = info.torch_info.optim_cls(params)
    assert {k: info.make(params).defaults.get(k, "(missing)") for k in ref.defaults} == ref.defaults


@optims(steps=False)
def test_errors(info):
    cases = error_inputs(info)
    assert len(cases) >= 6
    for e in cases:
        check_error(info, e)


@optims
@pytest.mark.parametrize("with_lrsched", [False, True])
@pytest.mark.parametrize("contiguous", [True, False])
def test_forloop_goes_right_direction(info, contiguous, with_lrsched):
    indices = config_indices(info, 2 * contiguous + with_lrsched, 4)
    sets = [info.scheduler_inputs[i] for i in shared(info, len(info.scheduler_inputs), contiguous, 2)]
    for c, scheduler_set in paired(indices, sets if with_lrsched else [[]]):
        kwargs = optim_inputs(info)[indices[c]]  # fresh: a tensor lr is scheduled in place
        if "foreach" in info.impls:
            kwargs["foreach"] = False
        prob = problem(info, contiguous=contiguous)
        opt = info.make(prob.params, **kwargs)
        schedulers = [s(opt) for s in scheduler_set]
        closure = prob.closure(opt)
        initial = closure().item()
        for _ in range(20):
            loss = closure()
            opt.step()
            step_schedulers(schedulers, loss)
        assert goes_right_direction(kwargs, initial, closure().item()), kwargs


@optims
def test_param_group_with_lrscheduler_goes_right_direction(info):
    for schedulers_c in [info.scheduler_inputs[i] for i in shared(info, len(info.scheduler_inputs))]:
        prob = problem(info, seed=5)
        groups = [{"params": [prob.weight]}] + ([{"params": [prob.bias], "lr": 0.01}] if prob.bias is not None else [])
        opt = info.make(groups)
        schedulers = [s(opt) for s in schedulers_c]
        closure = prob.closure(opt)
        initial = closure().item()
        for _ in range(20):
            loss = opt.step(closure)
            step_schedulers(schedulers, loss)
        assert closure().item() < initial


@optims
@pytest.mark.parametrize("num_dim", [0, 1, 2])
def test_tensor_lr(info, num_dim):
    for kwargs in configs(info, num_dim, 3):
        kwargs["lr"] = 1e-3
        prob = problem(info)
        prob_c = prob.clone()
        opt = info.make(prob.params, **kwargs)
        opt_c = info.make(prob_c.params, **{**kwargs, "lr": torch.tensor(1e-3).reshape([1] * num_dim)})
        for _ in range(5):
            opt.step(prob.closure(opt))
            opt_c.step(prob_c.closure(opt_c))
            assert_same(prob.params, prob_c.params)
        for a, b in zip(prob.params, prob_c.params):
            assert_same(opt.state[a], opt_c.state[b])


@optims(where=lambda i: i.complex_ok)
def test_complex(info):
    for kwargs in configs(info):
        gen = torch.Generator().manual_seed(0)
        complex_params = [
            torch.randn(10, 5, dtype=torch.complex64, generator=gen, requires_grad=True),
            torch.randn(10, dtype=torch.complex64, generator=gen, requires_grad=True),
            torch.randn(10, 5, dtype=torch.float32, generator=gen, requires_grad=True),  # real mixed in
        ]
        real_params = [
            (torch.view_as_real(p) if p.is_complex() else p).detach().clone().requires_grad_() for p in complex_params
        ]
        complex_opt, real_opt = info.make(complex_params, **kwargs), info.make(real_params, **kwargs)
        for _ in range(3):
            for pc, pr in zip(complex_params, real_params):
                pr.grad = torch.randn(pr.shape, generator=gen)
                pc.grad = torch.view_as_complex(pr.grad.clone()) if pc.is_complex() else pr.grad.clone()
            real_opt.step()
            complex_opt.step()
            for pc, pr in zip(complex_params, real_params):
                assert_same(torch.view_as_real(pc.detach()) if pc.is_complex() else pc.detach(), pr.detach())


def _rosenbrock(t):
    x, y = t
    return (1 - x) ** 2 + 100 * (y - x**2) ** 2


@optims(where=lambda i: i.complex_ok)
def test_complex_2d(info):
    if info.quantized:
        pytest.skip(
            "low-bit state is blockwise: one complex parameter puts real and imaginary parts in one block (one "
            "scale), two real parameters in two, so the quantized steps differ by design; fp32 state (shipped "
            "config) matches exactly"
        )
    for kwargs in configs(info):
        a1 = torch.randn(2, dtype=torch.complex64, generator=torch.Generator().manual_seed(0), requires_grad=True)
        re, im = a1.real.detach().clone().requires_grad_(), a1.imag.detach().clone().requires_grad_()
        opt1, opt2 = info.make([a1], **kwargs), info.make([re, im], **kwargs)
        for _ in range(3):
            opt1.zero_grad()
            opt2.zero_grad()
            _rosenbrock(a1).abs().backward()
            _rosenbrock(torch.complex(re, im)).abs().backward()
            assert_same(a1.grad.real, re.grad)
            assert_same(a1.grad.imag, im.grad)
            opt1.step()
            opt2.step()
            assert_same(a1.real.detach(), re.detach())
            assert_same(a1.imag.detach(), im.detach())


def _derived(info, flag, configs, dtype=torch.float64):
    """torch's ``_test_derived_optimizers``: flag False vs True, same parameters and state after 7 steps (here
    the same bits: the flags change nothing)."""
    x = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], dtype=dtype).reshape(3, 2)
    for kwargs in configs:
        runs = []
        for value in (False, True):
            torch.manual_seed(1)
            model = torch.nn.Sequential(
                torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 1), torch.nn.Sigmoid()
            )
            model.to(dtype=dtype)
            empty = torch.empty((), dtype=dtype, requires_grad=True)
            empty.grad = torch.rand_like(empty)
            params = list(model.parameters()) + [empty]
            opt = info.make(params, **kwargs, **{flag: value})
            for i in range(7):
                opt.zero_grad()
                model[2].requires_grad_(i not in (3, 4))  # a frozen layer for two steps, as torch's
                if i != 2:  # grads None: a no-op step
                    model(x).sum().backward()
                opt.step()
            runs.append((params[:-1], opt.state))  # the 0-dim parameter starts uninitialized: not compared
        (p0, s0), (p1, s1) = runs
        for a, b in zip(p0, p1):
            assert_bits(a.detach(), b.detach())
            assert_bits(s0[a], s1[b])


@optims(where=lambda i: "foreach" in i.impls)
def test_foreach_matches_forloop(info):
    _derived(info, "foreach", configs(info))


FUSED_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


@optims(where=lambda i: "fused" in i.impls)
@pytest.mark.parametrize("dtype", FUSED_DTYPES)
def test_fused_matches_forloop(info, dtype):
    _derived(info, "fused", configs(info, FUSED_DTYPES.index(dtype), len(FUSED_DTYPES)), dtype)


@optims(where=lambda i: "fused" in i.impls, steps=False)
def test_fused_error_on_params_on_meta(info):
    """torch raises RuntimeError for fused=True on meta parameters; ckptq refuses them for any flags, with
    UsageError, before a step builds state that would stay on meta after ``to_empty``."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 1))
    opt = info.make(model.parameters(), fused=True)
    with torch.device("meta"):
        for p in model.parameters():
            p.grad = torch.rand_like(p)
    with pytest.raises(UsageError, match="meta device.*to_empty"):
        opt.step()
    assert not opt.state
    opt.zero_grad(set_to_none=True)
    model.to_empty(device="cpu")
    for p in model.parameters():
        p.grad = torch.rand_like(p)
    opt.step()


@optims
def test_grads_are_never_inplaced_into(info):
    param = torch.randn((5, 1), requires_grad=True)
    for kwargs in configs(info):
        opt = info.make([param], **kwargs)
        param.grad = torch.rand_like(param)
        version, before = param.grad._version, param.grad.clone()
        for _ in range(5):
            opt.step(lambda: torch.tensor([1.0]))
        assert param.grad._version == version and torch.equal(param.grad, before), kwargs


@optims
def test_param_groups_weight_decay(info):
    for kwargs in configs(info):
        prob = problem(info)
        groups = [dict(params=[prob.weight], **kwargs)]
        if prob.bias is not None:
            groups.append(dict(params=[prob.bias], **{**kwargs, "weight_decay": 0.0}))
        opt = info.make(groups)
        initial = prob.loss().item()
        for _ in range(20):
            loss = prob.closure(opt)()
            opt.step()
        assert goes_right_direction(kwargs, initial, loss.item()), kwargs


@optims
def test_param_groups_lr(info):
    for kwargs in configs(info):
        if info.family == "Lion" and kwargs.get("decoupled_weight_decay"):
            continue  # lion-pytorch divides weight_decay by the constructor's lr (here 1e-28) in every group
        if not kwargs.get("lr"):
            kwargs["lr"] = 1e-3
        prob = problem(info)
        irrelevant = Parameter(torch.randn(2, 1) if info.two_d else torch.randn(2))
        before = irrelevant.detach().clone()
        opt = info.make([dict(params=prob.params, **kwargs), dict(params=[irrelevant])], lr=1e-28)
        initial = prob.loss().item()
        for _ in range(20):
            loss = prob.closure(opt)()
            irrelevant.grad = torch.rand_like(irrelevant)
            opt.step()
        assert goes_right_direction(kwargs, initial, loss.item()), kwargs
        assert_same(irrelevant.detach(), before)


@optims(steps=False)
def test_step_is_noop_when_params_have_no_grad(info):
    params = [torch.randn(2, 3, requires_grad=False) for _ in range(2)]
    old = [p.clone() for p in params]
    for kwargs in all_optim_inputs(info):
        info.make(params, **kwargs).step(lambda: torch.tensor([1.0]))
        assert_bits(params, old)


@optims(steps=False)
def test_step_is_noop_for_zero_grads(info):
    old = torch.randn((5, 1), generator=torch.Generator().manual_seed(0))
    for kwargs in all_optim_inputs(info):
        if kwargs.get("weight_decay", 0) != 0:
            continue  # decay moves parameters without gradients
        if info.defaults["weight_decay"] != 0:  # a default decay (AdamW's, Muon's, AdEMAMix's): as torch for AdamW
            kwargs["lr"] = torch.tensor(1e-5) if isinstance(kwargs.get("lr"), torch.Tensor) else 1e-5
        param = old.clone().requires_grad_()  # each config from the same values: the decay does not add up
        opt = info.make([param], **kwargs)
        param.grad = torch.zeros_like(param)
        opt.step(lambda: torch.tensor([1.0]))
        assert_same(param.detach(), old)


@optims(steps=False)
def test_optimizer_can_be_printed(info):
    params = small_params(info)
    for kwargs in all_optim_inputs(info):
        text = repr(info.make(params, **kwargs))
        assert info.optim_cls.__name__ in text and "lr:" in text


@optims(steps=False)
def test_non_empty_state(info):
    model = torch.nn.Linear(5, 5, bias=not info.two_d)
    x = torch.rand(2, 5)
    for kwargs in optim_inputs(info):
        opt = info.make(model.parameters(), **kwargs)
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        assert all(len(s) > 0 for s in opt.state.values())  # (SGD without momentum keeps none, as torch's)


@optims(where=lambda i: i.torch_info is not None and unsupported_error_inputs(i), steps=False)
def test_torch_error_inputs_that_ckptq_accepts(info):
    """torch refuses these (its foreach kernels take float scalars); here foreach changes nothing, so they
    must construct and step like their foreach=False twins."""
    for case in unsupported_error_inputs(info):
        outs = []
        for foreach in (True, False):
            p = Parameter(torch.ones(4, 4))
            opt = info.make([p], **{**case.kwargs, "foreach": foreach})
            p.grad = torch.full_like(p, 0.5)
            opt.step()
            outs.append(p.detach())
        assert_bits(outs[0], outs[1])
        assert not torch.equal(outs[0], torch.ones(4, 4)), UNSUPPORTED_ERRORS[case.desc]
