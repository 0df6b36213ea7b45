"""What the torch.optim conformance tests (tests/optim/test_torch_optim_*.py) run against: every class that
``ckptq.optim`` bundles, each as shipped (``min_size=4096``: the tests' small tensors keep fp32 state) and
with ``min_size=1`` (every parameter low-bit), with its inputs taken from PyTorch itself.

Where torch has the class (Adam, AdamW, SGD, RMSprop, Adagrad, NAdam, RAdam, Muon; the 4-bit classes map
to the same ones), the configs and the error inputs are those of its ``OptimizerInfo`` in
``torch.testing._internal.common_optimizers.optim_db`` (``optim_inputs_func(device="cpu")``,
``optim_error_inputs_func(device="cpu", ...)``, ``scheduler_inputs``), read fresh for every use (a config's
tensor ``lr`` is changed in place by schedulers). Lion8bit and AdEMAMix8bit have no torch class: their
configs and error inputs below are written in the same style, on lion-pytorch's and bitsandbytes' arguments.

What is left out of torch's inputs, and why:

- torch's ``differentiable=True`` configs (its cliquey flag): ckptq refuses it (low-bit moments carry no
  autograd history); ``foreach`` and ``fused`` are expanded as torch expands them, for the classes whose
  constructor takes them, and change nothing (test_foreach_matches_forloop / test_fused_matches_forloop
  check the bits).
- the error inputs in ``UNSUPPORTED_ERRORS``: torch refuses tensor hyperparameters with ``foreach=True``
  (its foreach kernels take float scalars); here ``foreach`` has no effect, so they work (tested).
- configs whose keys a class's constructor does not take (none today: ``dropped_inputs`` lists them, and a
  test checks that every one is explained in ``UNSUPPORTED_KEYS``).

Error inputs match when the exception has torch's type and its message opens as torch's regex does (the
regex may name torch's class where ckptq's message names its own: "Muon" for "Muon8bit").

Muon (torch's and ckptq's) takes 2-D parameters only: as torch's tests do, its problems use the weight
matrix alone (``problem``), and its model-based tests a bias-free ``Linear``.

How much runs. torch runs its tests over cross products (every config with every flag, under every
scheduler set, named or not, at every dtype...). For 20 classes in two configurations each that is
about 15 minutes of CPU here (a low-bit step of a rule without a C kernel yet runs on the PyTorch reference,
5 to 15 ms for these tiny tensors), so by default:

- every test runs on every class and configuration, and every torch config and error input runs in each
  test, once per family: the tests that step share a family's configs between AdamW8bit as shipped and
  AdamW8bit and AdamW4bit with ``min_size=1`` (``config_indices``), and a test's variants (named or not,
  layout, dtype, num_dim...) share them too; scheduler sets are paired with configs in turn (``paired``);
- the tests that step do not repeat a config with ``foreach=True`` / ``fused=True``: test_foreach_matches_
  forloop and test_fused_matches_forloop show that the flags change no bit; the tests that only build,
  print, hook or load take torch's expansion (``all_optim_inputs``);
- a 4-bit class as shipped keeps fp32 state for these tensors and steps as its 8-bit class, bit for bit
  (test_shipped_4bit_class_steps_as_its_8bit_class): the tests that step run its 4-bit path
  (``min_size=1``), not that copy (``Info.stepped``).

``CKPTQ_CONFORMANCE=full`` runs torch's cross products instead (all configs in every configuration,
variant and scheduler set; 4-bit classes as shipped stepped too).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re

import pytest
import torch
from torch.nn import Parameter

import ckptq.optim
from ckptq.optim import LowBitOptimizer


@functools.lru_cache(maxsize=1)
def torch_optim_db() -> dict:
    """torch's ``OptimizerInfo`` by class name. Importing torch's test helpers freezes torch.backends' global
    flags and sets TORCHINDUCTOR_CACHE_DIR for the whole process: both are undone, for the rest of the suite."""
    had_cache_dir = "TORCHINDUCTOR_CACHE_DIR" in os.environ
    from torch.testing._internal import common_optimizers

    setattr(torch.backends, "__allow_nonbracketed_mutation_flag", True)
    if not had_cache_dir:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    return {o.optim_cls.__name__: o for o in common_optimizers.optim_db}


def family(cls: type) -> str:
    """The optimizer a ckptq class implements: "AdamW" for AdamW8bit and AdamW4bit."""
    return re.sub(r"[48]bit$", "", cls.__name__)


CLASSES = tuple(c for c in (getattr(ckptq.optim, n) for n in ckptq.optim.__all__)
                if isinstance(c, type) and issubclass(c, LowBitOptimizer) and c is not LowBitOptimizer)
TWO_D_ONLY = ("Muon",)  # torch.optim.Muon's restriction, kept by Muon8bit
CLIQUEY = ("foreach", "fused")  # torch's global implementation flags that ckptq accepts (differentiable: refused)
DEFAULT_SCHEDULERS = (  # OptimizerInfo's default scheduler_inputs: one set of two
    [lambda opt: torch.optim.lr_scheduler.StepLR(opt, gamma=0.9, step_size=10),
     lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt)],
)


def _lion_inputs() -> list[dict]:
    """lion-pytorch's arguments (and bitsandbytes' Lion8bit's): lr, betas, weight_decay, decoupled_weight_decay."""
    return [{}, {"lr": 1e-3}, {"lr": torch.tensor(1e-3)}, {"betas": (0.95, 0.98)}, {"weight_decay": 0.1},
            {"weight_decay": 1e-2, "decoupled_weight_decay": True}]


def _ademamix_inputs() -> list[dict]:
    """bitsandbytes' AdEMAMix arguments: betas (b1, b2, b3), alpha, t_alpha, t_beta3, eps, weight_decay."""
    return [{}, {"lr": 0.01}, {"lr": torch.tensor(1e-3)}, {"weight_decay": 0.1},
            {"weight_decay": 0.1, "maximize": True}, {"betas": (0.8, 0.99, 0.999), "alpha": 8.0},
            {"t_alpha": 10, "t_beta3": 10}, {"eps": 1e-6, "weight_decay": 0.0}]


@dataclasses.dataclass
class ErrorCase:
    params: object
    kwargs: dict
    error_type: type
    regex: str
    on_step: bool  # raised by step() (torch's STEP_ERROR), else by the constructor
    desc: str


def _common_errors() -> list[ErrorCase]:
    from torch.testing._internal.common_optimizers import get_error_inputs_for_all_optims

    return [_case(e) for e in get_error_inputs_for_all_optims("cpu", torch.float32)]


def _lion_errors() -> list[ErrorCase]:
    """bitsandbytes' Lion8bit checks (lion-pytorch asserts lr > 0 and betas in [0, 1])."""
    return _common_errors() + [
        ErrorCase(None, {"lr": -1.0}, ValueError, "Invalid learning rate: -1.0", False, "lr below 0"),
        ErrorCase(None, {"betas": (1.5, 0.99)}, ValueError, "Invalid beta parameter at index 0: 1.5", False, "beta1"),
        ErrorCase(None, {"betas": (0.9, -0.1)}, ValueError, "Invalid beta parameter at index 1: -0.1", False, "beta2"),
        ErrorCase(None, {"weight_decay": -1}, ValueError, "Invalid weight_decay value: -1", False, "weight_decay"),
    ]


def _ademamix_errors() -> list[ErrorCase]:
    """bitsandbytes' AdEMAMix checks (``Optimizer2State``): lr, eps, each beta in [0, 1), weight_decay."""
    return _common_errors() + [
        ErrorCase(None, {"lr": -1.0}, ValueError, "Invalid learning rate: -1.0", False, "lr below 0"),
        ErrorCase(None, {"eps": -1.0}, ValueError, "Invalid epsilon value: -1.0", False, "eps below 0"),
        ErrorCase(None, {"betas": (0.9, 0.999, 1.0)}, ValueError, "Invalid beta parameter at index 2: 1.0", False,
                  "beta3"),
        ErrorCase(None, {"weight_decay": -1}, ValueError, "Invalid weight_decay value: -1", False, "weight_decay"),
    ]


OWN_INPUTS = {"Lion": _lion_inputs, "AdEMAMix": _ademamix_inputs}
OWN_ERRORS = {"Lion": _lion_errors, "AdEMAMix": _ademamix_errors}

# torch's error inputs ckptq does not reproduce (by their desc), and why
UNSUPPORTED_ERRORS = {
    "lr as Tensor doesn't work with foreach & not capturable": "foreach has no effect here (every step is one "
    "fused kernel call per group), so a tensor lr works with it",
    r"betas\[0\] as a Tensor is not supported for capturable=False and foreach=True": "the same: foreach has no "
    "effect, tensor betas work with it",
}
UNSUPPORTED_KEYS: dict[str, str] = {}  # config keys of torch's a class does not take, and why (none today)


def _case(e) -> ErrorCase:
    from torch.testing._internal.common_optimizers import OptimizerErrorEnum

    i = e.optimizer_error_input
    return ErrorCase(i.params, i.kwargs, e.error_type, e.error_regex, e.error_on == OptimizerErrorEnum.STEP_ERROR,
                     i.desc)


@dataclasses.dataclass(frozen=True)
class Info:
    """One class in one configuration, described as torch's ``OptimizerInfo`` describes its classes."""

    optim_cls: type
    extra: dict  # ckptq's own constructor arguments

    @property
    def name(self) -> str:
        return self.optim_cls.__name__ + "".join(f"-{k}{v}" for k, v in self.extra.items())

    @property
    def family(self) -> str:
        return family(self.optim_cls)

    @property
    def torch_info(self):
        """torch's OptimizerInfo for this class, or None (Lion, AdEMAMix)."""
        return torch_optim_db().get(self.family)

    @functools.cached_property
    def _built(self):
        return self.optim_cls([Parameter(torch.zeros(1, 1))])

    @property
    def defaults(self) -> dict:
        return self._built.defaults

    @property
    def bits(self) -> int:
        return self._built.bits

    @property
    def stepped(self) -> bool:
        """Whether the tests that step run this config: all but a 4-bit class as shipped, whose small test
        tensors keep fp32 state and step as its 8-bit class's, bit for bit (test_torch_optim_behaviour.py
        checks that for every config); its 4-bit path runs with ``min_size=1``."""
        return FULL or self.quantized or self.bits == 8

    @property
    def impls(self) -> tuple:
        """torch's cliquey flags this class's constructor takes (``supported_impls``, less differentiable)."""
        return tuple(f for f in CLIQUEY if f in self.defaults)

    @property
    def two_d(self) -> bool:
        return self.family in TWO_D_ONLY

    @property
    def complex_ok(self) -> bool:
        return self.optim_cls.complex_ok

    @property
    def quantized(self) -> bool:
        return self.extra.get("min_size") == 1

    @property
    def scheduler_inputs(self):
        return self.torch_info.scheduler_inputs if self.torch_info else DEFAULT_SCHEDULERS

    def make(self, params, **kwargs):
        return self.optim_cls(params, **{**self.extra, **kwargs})


INFOS = [Info(cls, extra) for cls in CLASSES for extra in ({}, {"min_size": 1})]


@pytest.fixture(scope="module")
def one_thread():
    """These tests step tiny tensors: torch's intra-op threads only add overhead (50x on 2 busy cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def optims(test=None, *, where=None, steps=True, known=None):
    """Parametrize a test over every Info (``where``: those it applies to), as torch's ``@optims(optim_db)``;
    ``steps``: a test that steps, which runs the ``Info.stepped`` configs; ``known(info)``: (exception type,
    why) where a known fault outside ``ckptq.optim`` makes it fail (a strict xfail: it fails once fixed)."""

    def decorate(test):
        infos = [i for i in INFOS if (where is None or where(i)) and (i.stepped or not steps)]
        params = []
        for i in infos:
            fault = known(i) if known else None
            marks = [pytest.mark.xfail(raises=fault[0], reason=fault[1], strict=True)] if fault else []
            params.append(pytest.param(i, marks=marks, id=i.name))
        return pytest.mark.parametrize("info", params)(test)

    return decorate(test) if test is not None else decorate


def _torch_inputs(info: Info) -> list[dict]:
    return [dict(i.kwargs) for i in info.torch_info.optim_inputs_func(device="cpu")]


def raw_inputs(info: Info) -> list[dict]:
    """The class's configs as its source gives them, fresh (new tensors) at every call."""
    return _torch_inputs(info) if info.torch_info else OWN_INPUTS[info.family]()


def dropped_inputs(info: Info) -> list[dict]:
    return [k for k in raw_inputs(info) if set(k) - set(info.defaults)]


# configs a class refuses by design, with its ArgumentError (tests/optim/test_optim_breadth.py holds the refusal):
# RMSprop4bit's centered=True (at 4 bits square_avg - grad_avg^2 is mostly rounding error)
REFUSED = {"RMSprop4bit": lambda k: bool(k.get("centered"))}


def optim_inputs(info: Info) -> list[dict]:
    """``optim_inputs_func(device="cpu")``: the configs this class takes."""
    refused = REFUSED.get(info.optim_cls.__name__, lambda k: False)
    return [k for k in raw_inputs(info) if not set(k) - set(info.defaults) and not refused(k)]


FULL = os.environ.get("CKPTQ_CONFORMANCE") == "full"  # torch's cross products (see the module docstring)


def config_indices(info: Info, k: int = 0, n: int = 1) -> list[int]:
    """Which of the class's configs variant ``k`` of a test's ``n`` runs (named parameters or not, a layout, a
    dtype...) in a test that steps. A family's stepped configurations (AdamW8bit as shipped, AdamW8bit and
    AdamW4bit with ``min_size=1``) share the configs: each config runs once per test and family, under one
    variant, each configuration and variant taking every ``3n``-th from its own offset (one at least). In
    FULL mode every configuration and variant runs every config, as torch runs them."""
    return shared(info, len(optim_inputs(info)), k, n)


def shared(info: Info, count: int, k: int = 0, n: int = 1) -> list[int]:
    """``config_indices`` for any ``count`` things a test runs through (configs, scheduler sets)."""
    if FULL:
        return list(range(count))
    family = [i for i in INFOS if i.family == info.family and i.stepped]
    offset, ways = family.index(info) + len(family) * k, len(family) * n
    return list(range(offset, count, ways)) or [offset % count]


def configs(info: Info, k: int = 0, n: int = 1) -> list[dict]:
    """The configs of ``config_indices``, fresh."""
    inputs = optim_inputs(info)
    return [inputs[i] for i in config_indices(info, k, n)]


def paired(configs: list, variants: list) -> list[tuple]:
    """(config index, variant) runs: each with each in FULL mode, as torch runs them; else cycled, each config
    and each variant once at least (max(len) runs)."""
    if FULL:
        return [(c, v) for v in variants for c in range(len(configs))]
    return [(k % len(configs), variants[k % len(variants)]) for k in range(max(len(configs), len(variants)))]


def all_optim_inputs(info: Info, skip=()) -> list[dict]:
    """torch's ``_get_optim_inputs_including_global_cliquey_kwargs``: each config with every cliquey flag the
    class takes False, then once with each of them True."""
    flags = [f for f in info.impls if f not in skip]
    out = []
    for kwargs in optim_inputs(info):
        out.append({**kwargs, **{f: False for f in flags}})
        out.extend({**kwargs, **{g: g == f for g in flags}} for f in flags)
    return out


def error_inputs(info: Info) -> list[ErrorCase]:
    """torch's error inputs for the class (``optim_error_inputs_func``), less ``UNSUPPORTED_ERRORS``."""
    if info.torch_info is None:
        return OWN_ERRORS[info.family]()
    cases = [_case(e) for e in info.torch_info.optim_error_inputs_func(device="cpu", dtype=torch.float32)]
    return [c for c in cases if c.desc not in UNSUPPORTED_ERRORS]


def unsupported_error_inputs(info: Info) -> list[ErrorCase]:
    if info.torch_info is None:
        return []
    cases = [_case(e) for e in info.torch_info.optim_error_inputs_func(device="cpu", dtype=torch.float32)]
    return [c for c in cases if c.desc in UNSUPPORTED_ERRORS]


def _opens_as(info: Info, regex: str, message: str) -> bool:
    """The message opens as torch's regex says, torch's class name read as ours where the regex names it."""
    own = regex.replace(info.family, info.optim_cls.__name__)
    return any(re.match(r, message) for r in (regex, own))


def check_error(info: Info, e: ErrorCase) -> None:
    params = e.params if e.params is not None else [Parameter(torch.randn(2, 2))]
    if issubclass(e.error_type, Warning):
        with pytest.warns(e.error_type) as record:
            opt = info.make(params, **e.kwargs)
            if e.on_step:
                opt.step()
        assert any(_opens_as(info, e.regex, str(w.message)) for w in record), (e.desc, [str(w.message) for w in record])
        return
    with pytest.raises(e.error_type) as raised:
        opt = info.make(params, **e.kwargs)
        if e.on_step:
            opt.step()
    assert _opens_as(info, e.regex, str(raised.value)), (e.desc, e.regex, str(raised.value))


def assert_same(a, b, path="", **tol) -> None:
    """torch's ``assertEqual`` over nested state: tensors by ``assert_close`` (default tolerances unless
    ``tol``), containers element by element, everything else by ``==``."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        torch.testing.assert_close(a, b, msg=lambda m: f"{path}: {m}", **tol)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}", **tol)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]", **tol)
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def assert_bits(a, b, path="") -> None:
    """``assert_same`` with no tolerance: the same bits (NaN equal to NaN)."""
    assert_same(a, b, path, rtol=0.0, atol=0.0, equal_nan=True)


@dataclasses.dataclass
class Problem:
    """torch's test problem: loss = sum((weight @ x + bias)^2); ``bias`` None for 2-D-only classes."""

    weight: Parameter
    bias: Parameter | None
    x: torch.Tensor

    @property
    def params(self) -> list:
        return [self.weight] if self.bias is None else [self.weight, self.bias]

    def loss(self) -> torch.Tensor:
        y = self.weight.mv(self.x)
        return (y if self.bias is None else y + self.bias).pow(2).sum()

    def closure(self, opt):
        def closure():
            opt.zero_grad()
            loss = self.loss()
            loss.backward()
            return loss

        return closure

    def clone(self) -> Problem:
        copy = lambda p: None if p is None else Parameter(p.detach().clone())  # noqa: E731
        return Problem(copy(self.weight), copy(self.bias), self.x)


def problem(info: Info, contiguous=True, seed=0, shape=(10, 5), dtype=torch.float32) -> Problem:
    gen = torch.Generator().manual_seed(seed)
    rows, cols = shape
    if contiguous:
        w, b = torch.randn(shape, generator=gen, dtype=dtype), torch.randn(rows, generator=gen, dtype=dtype)
    else:
        w = torch.randn((rows, cols, 2), generator=gen, dtype=dtype)[..., 0]
        b = torch.randn((rows, 2), generator=gen, dtype=dtype)[..., 0]
    x = torch.randn(cols, generator=gen, dtype=dtype)
    return Problem(Parameter(w), None if info.two_d else Parameter(b), x)


def small_params(info: Info, n=2, shape=(2, 3)) -> list:
    """``n`` random parameters of ``shape`` (torch's tests use (2, 3) and (5, 1): 2-D already)."""
    return [Parameter(torch.randn(shape)) for _ in range(n)]


def vector_param(info: Info, values=(1.0, 1.0)) -> torch.Tensor:
    """torch's 1-D hook-test parameter; a 1-row matrix for 2-D-only classes."""
    t = torch.tensor(values)
    return t.reshape(1, -1) if info.two_d else t


def conv_bn(info: Info):
    """torch's model for the state-dict loading tests (a bias-free Linear for 2-D-only classes) and its input."""
    torch.manual_seed(1)
    if info.two_d:
        return torch.nn.Linear(10, 4, bias=False), torch.rand(10)
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 2, 1, stride=2), torch.nn.BatchNorm2d(2, eps=1e-05, momentum=0.1))
    return model, torch.rand(1, 4, 16, 16)


def goes_right_direction(kwargs: dict, initial: float, final: float) -> bool:
    return final > initial if kwargs.get("maximize") else final < initial


def step_schedulers(schedulers, loss) -> None:
    for s in schedulers:
        s.step(loss.item()) if isinstance(s, torch.optim.lr_scheduler.ReduceLROnPlateau) else s.step()
