"""capturable=True (ckptq.optim.scalars): the step's scalars are computed on the parameters' device from
step tensors there. On the CPU it must give the bits of capturable=False, step for step and in its state
dict; in steady state (steps 2..5) ckptq's code must read nothing back to the host on the C and the
Triton backends (the Triton kernels run in the interpreter here); the capturable=False count is the one
docs/optimizers.md states. The device formulas equal the host's over many steps (ckptq.codec.scalar_math).
CUDA-graph capture itself is checked by tests/kernels/test_triton_cuda.py on a GPU.
"""

import collections
import contextlib
import os
import sys

import pytest
import torch

import ckptq
import ckptq.kernels
from ckptq.codec import ops, policy, quant, scalar_math
from ckptq.kernels import backend_native
from ckptq.kernels import rules
from ckptq.optim import Adam8bit, AdamW4bit, AdamW8bit, adam, scalars

CASES = [(AdamW8bit, {}), (AdamW4bit, {}), (Adam8bit, dict(amsgrad=True, maximize=True))]


def _model(seed=0, device="cpu"):
    """Two param groups (weight decay, lr), members of both in one kernel group; a small fp32 one."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in ((40, 65), (300,), (7,), (33, 8))]
    return params, [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0, "lr": 3e-3}]


def _run(cls, params, groups, steps, seed=1, start=0, opt=None, schedule=True, **kwargs):
    """``steps`` steps from step index ``start`` (each step's gradients depend on its index only), with a
    float lr that changes at every step when ``schedule``."""
    opt = opt or cls(groups, min_size=64, **kwargs)
    lambdas = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) if schedule else None
    for k in range(start, start + steps):
        gen = torch.Generator().manual_seed(1000 * seed + k)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.device)
        opt.step()
        if lambdas is not None:
            lambdas.step()
    return opt


def _assert_same_state_dicts(a: dict, b: dict) -> None:
    for ga, gb in zip(a["param_groups"], b["param_groups"]):
        assert {k: v for k, v in ga.items() if k != "capturable"} == {k: v for k, v in gb.items() if k != "capturable"}
    for pid, state in a["state"].items():
        for key, value in state.items():
            other = b["state"][pid][key]
            if not isinstance(value, dict):
                assert torch.equal(value, other), (pid, key)
                continue
            assert value.keys() == other.keys()
            for name, field in value.items():
                if isinstance(field, torch.Tensor):
                    assert torch.equal(field, other[name]), (pid, key, name)
                else:
                    assert type(field) is type(other[name]) and field == other[name], (pid, key, name)


@pytest.mark.parametrize("cls,kwargs", CASES, ids=[c.__name__ for c, _ in CASES])
def test_capturable_steps_give_the_bits_of_host_steps(cls, kwargs):
    host_params, host_groups = _model()
    dev_params, dev_groups = _model()
    host = _run(cls, host_params, host_groups, 4, **kwargs)
    dev = _run(cls, dev_params, dev_groups, 4, capturable=True, **kwargs)
    for a, b in zip(host_params, dev_params):
        assert torch.equal(a, b)
    state = dev.state[dev_params[0]]
    assert isinstance(state["step"], torch.Tensor) and state["step"].device == dev_params[0].device
    assert isinstance(state["exp_avg"]["eps"], torch.Tensor)  # kept on the device, exported as a float
    _assert_same_state_dicts(host.state_dict(), dev.state_dict())


def test_a_capturable_state_dict_resumes_anywhere_bit_for_bit():
    """Saved by a capturable run after 2 steps: resumed by a capturable and by a host optimizer, 2 more
    steps equal the uninterrupted 4; torch's AdamW reads it too."""
    params, groups = _model()
    _run(AdamW4bit, params, groups, 4, capturable=True, schedule=False)
    saved_params, saved_groups = _model()
    saved = _run(AdamW4bit, saved_params, saved_groups, 2, capturable=True, schedule=False).state_dict()
    assert type(saved["state"][0]["exp_avg"]["eps"]) is float
    for capturable in (True, False):
        resumed_params, resumed_groups = _model()
        for p, s in zip(resumed_params, saved_params):
            p.data.copy_(s)
        opt = AdamW4bit(resumed_groups, min_size=64, capturable=capturable)
        opt.load_state_dict(saved)
        assert opt.state[resumed_params[0]]["step"].device == resumed_params[0].device
        _run(AdamW4bit, resumed_params, resumed_groups, 2, start=2, opt=opt, schedule=False)
        for a, b in zip(params, resumed_params):
            assert torch.equal(a, b), capturable
    torch_sd = ckptq.optim.to_torch_state_dict(saved)
    assert torch_sd["state"][0]["exp_avg"].dtype == torch.float32


def test_device_scalars_equal_the_host_scalars_over_many_steps():
    """20,000 steps of several betas, both weight-decay kinds: every hyper field and eps' (float64, as the
    state dict exports it) as the host computes them, and the fp32 rows the kernels read."""
    x = scalar_math.DeviceMath("cpu")
    steps = torch.arange(1, 20001, dtype=torch.float64)
    for beta1, beta2, lr, wd in ((0.9, 0.999, 1e-3, 0.1), (0.95, 0.9999, 3e-4, 0.0), (0.8, 0.99, 0.1, 1e-2)):
        for decoupled in (True, False):
            named = adam.adam_fields(x, lr, beta1, beta2, 1e-8, wd, steps, decoupled)
            fields = [torch.as_tensor(named[k], dtype=torch.float64).expand(len(steps)) for k in rules.ADAM_FIELDS[:8]]
            enc = named["encode_eps"]
            for i in range(0, len(steps), 997):  # the host loop is slow: every 997th step, and the last ones
                host = adam.hyper_values(lr, beta1, beta2, 1e-8, wd, i + 1, decoupled)
                assert [float(f[i]) for f in fields] == list(host), (beta1, beta2, i + 1)
                assert float(enc[i]) == policy.ratio_eps(1e-8, beta2, i + 1)
            host_rows = torch.tensor([adam.hyper_values(lr, beta1, beta2, 1e-8, wd, s, decoupled)
                                      for s in range(1, 20001)], dtype=torch.float32)
            assert torch.equal(torch.stack(fields, 1).to(torch.float32), host_rows)
            host_enc = torch.tensor([policy.ratio_eps(1e-8, beta2, s) for s in range(1, 20001)], dtype=torch.float64)
            assert torch.equal(enc, host_enc)
    salts = [0, 1, 7, 2**20 + 3]
    step_ints = torch.tensor([1, 2, 2**31 + 5, 2**24], dtype=torch.int64)
    got = scalars.seeds(step_ints, scalars.salt_hash(salts, "cpu")).tolist()
    assert got == [ops.step_seed(int(s), salt) for s, salt in zip(step_ints, salts)]


ROOTS = tuple(os.path.dirname(m.__file__) + os.sep for m in (ckptq, ckptq.kernels))
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")


@contextlib.contextmanager
def host_reads():
    """Counts the Tensor methods that read values back to the host when ckptq's own code calls them (the
    immediate caller's file is in the package), not torch's or Triton's interpreter's."""
    seen = collections.Counter()
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name, method):
        def counted(self, *args, **kwargs):
            caller = sys._getframe(1).f_code
            if caller.co_filename.startswith(ROOTS):
                seen[f"{name} at {os.path.basename(caller.co_filename)}:{sys._getframe(1).f_lineno}"] += 1
            return method(self, *args, **kwargs)
        return counted

    for name, method in originals.items():
        setattr(torch.Tensor, name, counting(name, method))
    try:
        yield seen
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)


def _reads_cases():
    native = pytest.mark.skipif(not backend_native.available(), reason="the C kernels are unavailable")
    triton = pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                                reason="Triton cannot run here")
    return [pytest.param("native", True, "fresh", marks=native), pytest.param("native", False, "fresh", marks=native),
            pytest.param("native", True, "plain first moments", marks=native),
            pytest.param("triton", True, "fresh", marks=triton)]  # the interpreter is slow: one case


def _plain_first_moments(opt, params):
    """The state as an older ckptq file holds it: exp_avg plain (not yet a ratio), re-encoded by the first step."""
    sd = opt.state_dict()
    for pid, p in enumerate(params):
        state = sd["state"][pid]
        if isinstance(state["exp_avg"], dict):
            dense = quant.dequantize_states(state)
            state["exp_avg"] = quant.quantize_state(dense["exp_avg"], "exp_avg", 128, bits=4)
    opt.load_state_dict(sd)


@pytest.mark.parametrize("backend,capturable,start", _reads_cases())
def test_steady_steps_read_nothing_back_to_the_host(backend, capturable, start):
    """Fresh state, or a loaded older state whose first step re-encodes exp_avg as a ratio (and changes
    the plan: it is rebuilt at the end of that step, not in the next)."""
    params, groups = _model(device="cuda" if backend == "triton" and torch.cuda.is_available() else "cpu")
    opt = AdamW4bit(groups, min_size=64, capturable=capturable, backend=backend)
    _run(AdamW4bit, params, groups, 1, opt=opt)
    if start != "fresh":
        _plain_first_moments(opt, params)
        _run(AdamW4bit, params, groups, 1, start=1, opt=opt)
    with host_reads() as seen:
        _run(AdamW4bit, params, groups, 4, start=2, opt=opt)  # steps 2..5 (the lr schedule's floats change)
    # capturable=False: the step counts, one tolist per step (docs/optimizers.md)
    assert dict(seen) == ({} if capturable else {f"tolist at plan.py:{_TOLIST_LINE}": 4})


def _tolist_line() -> int:
    import inspect

    from ckptq.optim import plan

    lines, first = inspect.getsourcelines(plan.StepPlan.step)
    return first + next(i for i, line in enumerate(lines) if ".tolist()" in line)


_TOLIST_LINE = _tolist_line()
