"""The optimizer descriptions for the torch.optim conformance tests (tests/test_torch_optim_*.py).

Built like PyTorch's ``OptimizerInfo`` entry for ``AdamW`` in ``torch/testing/_internal/common_optimizers.py``
(its CPU configs, its error inputs, its global "cliquey" flags), written here so the tests run without
torch's internal test modules (they need ``expecttest`` and a PyTorch source tree). Each ckptq optimizer is
described twice: as shipped (``min_size=4096``: small test tensors keep fp32 state) and with ``min_size=1``
(every parameter has 8-bit state).
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch.nn import Parameter

from ckptq.optim import Adam8bit, AdamW8bit


@dataclasses.dataclass(frozen=True)
class Info:
    optim_cls: type
    extra: dict  # ckptq's own constructor arguments
    # torch's global "cliquey" flags this optimizer accepts with True; ``differentiable`` is refused
    supported_impls: tuple = ("foreach", "fused")

    @property
    def name(self) -> str:
        return self.optim_cls.__name__ + "".join(f"-{k}{v}" for k, v in self.extra.items())

    def make(self, params, **kwargs):
        return self.optim_cls(params, **{**self.extra, **kwargs})


INFOS = [Info(cls, extra) for cls in (AdamW8bit, Adam8bit) for extra in ({}, {"min_size": 1})]


@pytest.fixture(scope="module")
def one_thread():
    """These tests step tiny tensors: torch's intra-op threads only add overhead (50x on 2 busy cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def optims(test):
    """Parametrize a test over every Info, as torch's ``@optims(optim_db)``."""
    return pytest.mark.parametrize("info", INFOS, ids=[i.name for i in INFOS])(test)


def optim_inputs(info: Info) -> list[dict]:
    """torch's CPU configs for Adam and AdamW (``optim_inputs_func_adam``), without cliquey flags."""
    return [
        {},
        {"lr": 0.01},
        {"weight_decay": 0.1},
        {"weight_decay": 0.1, "maximize": True},
        {"weight_decay": 0.1, "amsgrad": True},
    ]


def all_optim_inputs(info: Info, skip=()) -> list[dict]:
    """torch's ``_get_optim_inputs_including_global_cliquey_kwargs``: each config with every supported
    cliquey flag False, then once with each of them True."""
    flags = [f for f in info.supported_impls if f not in skip]
    out = []
    for kwargs in optim_inputs(info):
        out.append({**kwargs, **{f: False for f in flags}})
        out.extend({**kwargs, **{g: g == f for g in flags}} for f in flags)
    return out


@dataclasses.dataclass
class ErrorInput:
    params: object
    kwargs: dict
    error_type: type
    error_regex: str
    desc: str


def error_inputs() -> list[ErrorInput]:
    """torch's ``get_error_inputs_for_all_optims`` plus ``optim_error_inputs_func_adam`` (CPU), less the two
    that ``UNSUPPORTED_ERRORS`` explains."""
    p, p2 = Parameter(torch.randn(1, 1)), Parameter(torch.randn(1, 1))
    tb = (torch.tensor(0.9), torch.tensor(0.99))
    return [
        ErrorInput(p, {}, TypeError, "params argument given to the optimizer should be an iterable", "param type"),
        ErrorInput([p, p], {}, UserWarning, ".*a parameter group with duplicate parameters.*", "duplicates"),
        ErrorInput([{"params": p}, {"params": p}], {}, ValueError, "some parameters appear in more than one", "dup"),
        ErrorInput(None, dict(lr=torch.tensor([0.001, 0.001])), ValueError, "Tensor lr must be 1-element", "lr"),
        ErrorInput([("weight", p), p2], {}, ValueError, "all optimizer params should be with/without names", "n"),
        ErrorInput(
            [{"params": [p], "lr": 1e-2}, {"params": [("weight", p2)]}], {}, ValueError,
            "all optimizer param groups should be with/without names", "group names",
        ),
        ErrorInput(None, dict(lr=1e-2, betas=(1.0, 0.0)), ValueError, "Invalid beta parameter at index 0: 1.0", "b1"),
        ErrorInput(None, dict(lr=1e-2, weight_decay=-1), ValueError, "Invalid weight_decay value: -1", "wd"),
        ErrorInput(None, dict(lr=1e-2, betas=(0.9, tb[1])), ValueError, "betas must be either both floats", "b"),
        ErrorInput(None, dict(lr=1e-2, betas=(tb[0], 0.99)), ValueError, "betas must be either both floats", "b"),
    ]


# torch's error inputs ckptq does not reproduce, and why (the README lists them too)
UNSUPPORTED_ERRORS = {
    "lr as Tensor with foreach=True": "foreach has no effect here (every step is one fused kernel per parameter), "
    "so a tensor lr works with it",
    "betas as Tensors with foreach=True": "the same: foreach has no effect, tensor betas work with it",
}


def check_error(info: Info, e: ErrorInput) -> None:
    params = e.params if e.params is not None else [Parameter(torch.randn(2, 2))]
    if issubclass(e.error_type, Warning):
        with pytest.warns(e.error_type, match=e.error_regex):
            info.make(params, **e.kwargs)
    else:
        with pytest.raises(e.error_type, match=re.compile(e.error_regex)):
            info.make(params, **e.kwargs)


def assert_same(a, b, path="", **tol) -> None:
    """torch's ``assertEqual`` over nested state: tensors by ``assert_close`` (default fp32 tolerances
    unless ``tol``), containers element by element, everything else by ``==``."""
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


def weight_bias(dtype=torch.float32, contiguous=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if contiguous:
        w, b = torch.randn((10, 5), generator=gen, dtype=dtype), torch.randn(10, generator=gen, dtype=dtype)
    else:
        w = torch.randn((10, 5, 2), generator=gen, dtype=dtype)[..., 0]
        b = torch.randn((10, 2), generator=gen, dtype=dtype)[..., 0]
    return Parameter(w), Parameter(b), torch.randn(5, generator=gen, dtype=dtype)

