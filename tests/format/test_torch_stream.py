"""The streaming torch.save writer: what torch.load(weights_only=True) reads back is what was given."""

import collections

import torch
from hypothesis import HealthCheck, given, settings

from ckptq.format import torch_stream
from tests.format.test_format import assert_same, trees


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


def test_exotic_dtypes_and_complex_views_survive_save_load_and_expand(tmp_path):
    """float8 / uint16 have no typed storage class; complex64 is stored as bytes; views stay views."""
    import ckptq

    obj = {"f8": torch.randn(10).to(torch.float8_e4m3fn), "u16": torch.arange(5, dtype=torch.int32).to(torch.uint16),
           "c": torch.randn(10, dtype=torch.complex64)[2:5], "ct": torch.randn(3, 4, dtype=torch.complex64).t()}
    raw = str(tmp_path / "x.pt")
    torch_stream.save(obj, raw)
    ckptq.save(obj, str(tmp_path / "x.safetensors"))
    ckptq.expand(str(tmp_path / "x.safetensors"), str(tmp_path / "y.pt"))
    for back in (torch.load(raw, weights_only=True), ckptq.load(str(tmp_path / "x.safetensors")),
                 torch.load(str(tmp_path / "y.pt"), weights_only=True)):
        for k, v in obj.items():
            assert back[k].dtype == v.dtype and back[k].shape == v.shape and back[k].stride() == v.stride(), k
            assert torch.equal(back[k].contiguous().view(torch.uint8), v.contiguous().view(torch.uint8)), k
