"""PyTorch's generic optimizer tests (``TestOptimRenewed`` in ``test/test_optim.py``, CPU) against ckptq's
AdamW8bit and Adam8bit, each as shipped and with ``min_size=1`` (tests/optim_conformance.py builds the
``OptimizerInfo``-like descriptions). Written from torch's tests, checking the same behaviour; the hook
and state-dict tests are in tests/test_torch_optim_state.py.

Not here, and why:
- CUDA-only tests and those torch itself skips on the CPU (``test_fused_large_tensor``: 64 GB,
  ``test_cpu_load_state_dict``, ``test_state_dict_with_cuda_params``, ``test_mixed_device_dtype``,
  ``test_peak_memory_foreach``, ``test_foreach_large_tensor``, ``test_set_default_dtype_works_with_foreach``,
  ``test_forloop_goes_right_direction_multigpu``, ``test_defaults_changed_to_foreach``,
  ``test_fused_cpu_matches_cuda``, ``test_fused_does_not_step_if_foundinf``): no GPU in CI; the Triton path
  is tested in tests/test_kernels_*.py. The last one passes ``grad_scale``/``found_inf`` to torch's fused
  kernels, which ckptq does not have; ``GradScaler``'s generic path is tested in tests/test_optim_api.py.
- Tests for features these optimizers do not have: sparse gradients (``test_rosenbrock_sparse``), closures
  that must be called (``test_second_order_optims_return_consistent_types``), ``differentiable=True`` configs
  (refused: 8-bit moments carry no autograd history), and torch-only ones (``test_adamw_serialization``,
  ``test_step_iteration``).
"""

import pytest
import torch
from torch.nn import Parameter
from torch.optim.lr_scheduler import ReduceLROnPlateau, StepLR

from ckptq.errors import UsageError
from optim_conformance import (  # noqa: F401 (one_thread: a fixture)
    INFOS, UNSUPPORTED_ERRORS, all_optim_inputs, assert_same, check_error, error_inputs, one_thread, optim_inputs,
    optims, weight_bias,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("info", INFOS[:1], ids=["all"])
def test_optim_infos_do_not_specify_global_cliquey_kwargs(info):
    for i in INFOS:
        for kwargs in optim_inputs(i):
            assert not {"foreach", "fused", "differentiable"} & set(kwargs)


@optims
def test_errors(info):
    for e in error_inputs():
        check_error(info, e)


@optims
@pytest.mark.parametrize("with_lrsched", [False, True])
@pytest.mark.parametrize("contiguous", [True, False])
def test_forloop_goes_right_direction(info, contiguous, with_lrsched):
    for kwargs in optim_inputs(info):
        weight, bias, x = weight_bias(contiguous=contiguous)
        opt = info.make([weight, bias], foreach=False, **kwargs)
        scheds = [StepLR(opt, gamma=0.9, step_size=10), ReduceLROnPlateau(opt)] if with_lrsched else []

        def closure():
            opt.zero_grad()
            loss = (weight.mv(x) + bias).pow(2).sum()
            loss.backward()
            return loss

        initial = closure().item()
        for _ in range(20):
            loss = opt.step(closure)
            for sched in scheds:
                sched.step(loss.item()) if isinstance(sched, ReduceLROnPlateau) else sched.step()
        if kwargs.get("maximize"):
            assert closure().item() > initial, kwargs
        else:
            assert closure().item() < initial, kwargs


@optims
def test_complex(info):
    for kwargs in all_optim_inputs(info):
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


@optims
def test_complex_2d(info):
    if info.extra.get("min_size") == 1:
        pytest.skip(
            "8-bit state is blockwise: one complex parameter puts real and imaginary parts in one block (one "
            "scale), two real parameters in two, so the quantized steps differ by design; fp32 state (shipped "
            "config) matches exactly"
        )
    for kwargs in all_optim_inputs(info):
        a1 = torch.randn(2, dtype=torch.complex64, generator=torch.Generator().manual_seed(0), requires_grad=True)
        re, im = a1.real.detach().clone().requires_grad_(), a1.imag.detach().clone().requires_grad_()
        opt1, opt2 = info.make([a1], **kwargs), info.make([re, im], **kwargs)
        for _ in range(10):
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


def _derived(info, flag, dtype=torch.float64):
    """torch's ``_test_derived_optimizers``: flag False vs True, same parameters and state after 7 steps."""
    x = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], dtype=dtype).reshape(3, 2)
    for kwargs in optim_inputs(info):
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
                if i != 3:  # grads None: a no-op step
                    model(x).sum().backward()
                opt.step()
            runs.append((params[:-1], opt.state))  # the 0-dim parameter starts uninitialized: not compared
        (p0, s0), (p1, s1) = runs
        for a, b in zip(p0, p1):
            assert_same(a.detach(), b.detach())
            assert_same(s0[a], s1[b])


@optims
def test_foreach_matches_forloop(info):
    _derived(info, "foreach")


@optims
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_fused_matches_forloop(info, dtype):
    _derived(info, "fused", dtype)


@optims
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
    for kwargs in all_optim_inputs(info):
        opt = info.make([param], **kwargs)
        param.grad = torch.rand_like(param)
        version, before = param.grad._version, param.grad.clone()
        for _ in range(5):
            opt.step(lambda: torch.tensor([1.0]))
        assert param.grad._version == version and torch.equal(param.grad, before), kwargs


@optims
def test_param_groups_weight_decay(info):
    for kwargs in all_optim_inputs(info):
        weight, bias, x = weight_bias()
        opt = info.make([dict(params=[weight], **kwargs), dict(params=[bias], **{**kwargs, "weight_decay": 0.0})])
        initial = (weight.mv(x) + bias).pow(2).sum().item()
        for _ in range(20):
            opt.zero_grad()
            loss = (weight.mv(x) + bias).pow(2).sum()
            loss.backward()
            opt.step()
        assert (loss.item() > initial) if kwargs.get("maximize") else (loss.item() < initial), kwargs


@optims
def test_param_groups_lr(info):
    for kwargs in all_optim_inputs(info):
        kwargs = {**kwargs, "lr": kwargs.get("lr") or 1e-3}
        weight, bias, x = weight_bias()
        irrelevant = Parameter(torch.randn(2))
        before = irrelevant.detach().clone()
        opt = info.make([dict(params=[weight, bias], **kwargs), dict(params=[irrelevant])], lr=1e-28)
        initial = (weight.mv(x) + bias).pow(2).sum().item()
        for _ in range(20):
            opt.zero_grad()
            loss = (weight.mv(x) + bias).pow(2).sum()
            loss.backward()
            irrelevant.grad = torch.rand_like(irrelevant)
            opt.step()
        assert (loss.item() > initial) if kwargs.get("maximize") else (loss.item() < initial), kwargs
        assert_same(irrelevant.detach(), before)


@optims
def test_step_is_noop_when_params_have_no_grad(info):
    params = [torch.randn(2, 3, requires_grad=False) for _ in range(2)]
    old = [p.clone() for p in params]
    for kwargs in all_optim_inputs(info):
        info.make(params, **kwargs).step(lambda: torch.tensor([1.0]))
        assert_same(params, old)


@optims
def test_step_is_noop_for_zero_grads(info):
    param = torch.randn((5, 1), requires_grad=True)
    old = param.detach().clone()
    for kwargs in all_optim_inputs(info):
        if kwargs.get("weight_decay", 0) != 0:
            continue  # decay moves parameters without gradients
        if info.optim_cls.__name__ == "AdamW8bit":
            kwargs = {**kwargs, "lr": 1e-4}  # default decay 1e-2 * lr 1e-4 stays within fp32 tolerance, as in torch
        opt = info.make([param], **kwargs)
        param.grad = torch.zeros_like(param)
        opt.step(lambda: torch.tensor([1.0]))
        assert_same(param.detach(), old)


@optims
def test_optimizer_can_be_printed(info):
    params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
    for kwargs in all_optim_inputs(info):
        text = repr(info.make(params, **kwargs))
        assert type(info.make(params)).__name__ in text and "lr:" in text


@optims
def test_non_empty_state(info):
    for kwargs in all_optim_inputs(info):
        params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
        opt = info.make(params, **kwargs)
        for p in params:
            p.grad = torch.rand_like(p)
        opt.step()
        assert all(opt.state[p] for p in params)


@optims
@pytest.mark.parametrize("num_dim", [0, 1, 2])
def test_tensor_lr(info, num_dim):
    for kwargs in all_optim_inputs(info):
        lr = kwargs.get("lr", 1e-3)
        weight, bias, x = weight_bias()
        weight_c, bias_c = Parameter(weight.detach().clone()), Parameter(bias.detach().clone())
        opt = info.make([weight, bias], **{**kwargs, "lr": lr})
        opt_c = info.make([weight_c, bias_c], **{**kwargs, "lr": torch.tensor(lr).reshape([1] * num_dim)})
        for _ in range(5):
            for o, w, b in ((opt, weight, bias), (opt_c, weight_c, bias_c)):
                o.zero_grad()
                (w.mv(x) + b).pow(2).sum().backward()
                o.step()
            assert_same(weight.detach(), weight_c.detach())
            assert_same(bias.detach(), bias_c.detach())
        for a, b in ((weight, weight_c), (bias, bias_c)):
            assert_same(opt.state[a], opt_c.state[b])


@optims
@pytest.mark.parametrize("desc", sorted(UNSUPPORTED_ERRORS))
def test_torch_error_inputs_that_ckptq_accepts(info, desc):
    """torch refuses these (its foreach kernels take float scalars); here foreach changes nothing, so they
    must construct and step like their foreach=False twins."""
    kwargs = {"lr": torch.tensor(1e-3)} if desc.startswith("lr") else {"betas": (torch.tensor(0.9), torch.tensor(0.99))}
    outs = []
    for foreach in (True, False):
        p = Parameter(torch.ones(4, 4))
        opt = info.make([p], foreach=foreach, **kwargs)
        p.grad = torch.full_like(p, 0.5)
        opt.step()
        outs.append(p.detach())
    assert_same(outs[0], outs[1])
    assert not torch.equal(outs[0], torch.ones(4, 4))
