"""ckptq.optim behaves like a torch.optim optimizer where users touch it: argument errors, torch's
implementation flags. The generic torch tests are in tests/test_torch_optim_*.py."""

import pytest
import torch

from ckptq.errors import ArgumentError, CkptqError, UsageError
from ckptq.optim import Adam8bit, AdamW8bit


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
    (dict(capturable=True), "capturable=True is not supported"),
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
                                   dict(capturable=False, differentiable=False)])
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
