"""The streaming torch.save writer: what torch.load(weights_only=True) reads back is what was given."""

import collections

import torch
from hypothesis import HealthCheck, given, settings

from ckptq import torch_stream
from test_format import assert_same, trees


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(obj=trees)
def test_real_tensors_round_trip_like_torch_save(obj, tmp_path):
    path = str(tmp_path / "x.pt")
    torch_stream.save(obj, path)
    assert_same(obj, torch.load(path, weights_only=True))


def test_lazy_tensors_are_produced_once_each_and_shared(tmp_path):
    calls = []

    def produce():
        calls.append(1)
        return torch.arange(12, dtype=torch.float32)

    storage = torch_stream.LazyStorage(torch.float32, 12, produce)
    a = torch_stream.LazyTensor(storage, (3, 4))
    b = torch_stream.LazyTensor(storage, (3, 4))
    p = torch_stream.LazyTensor(torch_stream.LazyStorage(torch.bfloat16, 2, lambda: torch.ones(2)), (2,), parameter=True)
    big = torch.randn(1000)
    obj = {"a": a, "b": b, "p": p, "view": big[10:20], "od": collections.OrderedDict(x=big)}
    path = str(tmp_path / "lazy.pt")
    seen = []
    torch_stream.save(obj, path, lambda done, total: seen.append((done, total)))
    assert len(calls) == 1 and seen[-1][0] == seen[-1][1] == 12 * 4 + 2 * 2 + 1000 * 4
    back = torch.load(path, weights_only=True)
    assert torch.equal(back["a"], torch.arange(12.0).view(3, 4)) and back["a"].data_ptr() == back["b"].data_ptr()
    assert isinstance(back["p"], torch.nn.Parameter) and back["p"].dtype == torch.bfloat16
    assert torch.equal(back["view"], big[10:20]) and back["view"].untyped_storage().data_ptr() == back["od"]["x"].data_ptr()
