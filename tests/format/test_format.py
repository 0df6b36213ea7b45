"""Round trips of arbitrary checkpoint structures through the ckptq format, and the reader's defences."""

import collections
import json
import math
import os
import struct
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

import ckptq
from ckptq import format
from ckptq.format import integrity
from ckptq.codec import quant
from ckptq.errors import ChecksumError, FormatError, InputError, OutputExistsError

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool, torch.complex64]


def assert_same(a, b, path="root"):
    """Same types, keys, values; tensors bit-identical with the same dtype, shape and strides."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), path
        assert torch.equal(a.reshape(-1).view(torch.uint8) if a.numel() and a.is_contiguous() else a.cpu(),
                           b.reshape(-1).view(torch.uint8) if b.numel() and b.is_contiguous() else b.cpu()), path
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        assert all(type(k1) is type(k2) for k1, k2 in zip(a, b)), path
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), path
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, path
        if isinstance(a, float):
            assert math.copysign(1, a) == math.copysign(1, b), path


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    t = (torch.randn(shape, generator=g, dtype=torch.float64) * 100).to(dtype)
    if draw(st.booleans()) and t.dim() == 2:
        t = t.t()  # non-contiguous
    return t


scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.text(max_size=8),
                    st.floats(allow_nan=True, allow_infinity=True))
keys = st.one_of(st.text(max_size=6), st.integers(-5, 5))
trees = st.recursive(
    st.one_of(scalars, tensors()),
    lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.lists(kids, max_size=3).map(tuple),
        st.dictionaries(keys, kids, max_size=4),
        st.dictionaries(st.text(max_size=6), kids, max_size=3).map(collections.OrderedDict),
    ),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(obj=trees)
def test_any_structure_round_trips_exactly(obj, tmp_path):
    path = str(tmp_path / "x.safetensors")
    ckptq.save(obj, path, force=True)
    assert_same(obj, ckptq.load(path))


def test_shared_storage_and_views_are_restored_shared(tmp_path):
    base = torch.arange(24, dtype=torch.float32)
    emb = torch.randn(10, 4)
    obj = {"wte": emb, "head": emb, "view": base[3:9].view(2, 3), "t": base.view(4, 6).t(), "whole": base,
           "param": torch.nn.Parameter(torch.ones(3)), "size": torch.Size([2, 3]), "dt": torch.bfloat16,
           "dev": torch.device("cpu")}
    path = str(tmp_path / "s.safetensors")
    ckptq.save(obj, path)
    back = ckptq.load(path)
    assert_same({k: v for k, v in obj.items() if k != "param"}, {k: v for k, v in back.items() if k != "param"})
    assert isinstance(back["param"], torch.nn.Parameter) and torch.equal(back["param"], obj["param"])
    assert back["wte"].data_ptr() == back["head"].data_ptr()
    s = back["whole"].untyped_storage().data_ptr()
    assert back["view"].untyped_storage().data_ptr() == s == back["t"].untyped_storage().data_ptr()
    back["whole"][3] = -1.0  # a write through one view is seen by the others, as in the original
    assert back["view"][0, 0] == -1.0
    with safe_open(path, "pt") as f:  # stored once
        assert sum(1 for k in f.keys() if f.get_slice(k).get_shape() == [24]) == 1
    ckptq.expand(path, str(tmp_path / "e.pt"))  # the streaming torch.save keeps the sharing too
    e = torch.load(tmp_path / "e.pt", weights_only=True)
    assert_same({k: v for k, v in obj.items() if k != "param"}, {k: v for k, v in e.items() if k != "param"})
    assert e["view"].untyped_storage().data_ptr() == e["whole"].untyped_storage().data_ptr() == e["t"].untyped_storage().data_ptr()
    assert e["wte"].data_ptr() == e["head"].data_ptr()


def _qstate_obj():
    g = torch.Generator().manual_seed(0)
    m = torch.randn(5000, generator=g) * 1e-3
    v = torch.rand(70, 70, generator=g) ** 6 * 1e-4
    m2 = torch.randn(70, 70, generator=g) * v.sqrt()
    return {"optimizer": {"state": {0: {"step": torch.tensor(10.0), "exp_avg": quant.quantize_state(m, "exp_avg"),
                                        "exp_avg_sq": quant.quantize_state(v, "exp_avg_sq")},
                                    1: {"step": torch.tensor(10.0), "exp_avg": quant.quantize_ratio(m2, v, 1e-9),
                                        "exp_avg_sq": quant.quantize_state(v, "exp_avg_sq")}},
                          "param_groups": [{"lr": 1e-3, "params": [0, 1]}]}}, m, v


def test_quantized_states_load_quantized_or_dequantized(tmp_path):
    obj, m, v = _qstate_obj()
    path = str(tmp_path / "q.safetensors")
    ckptq.save(obj, path)
    q = ckptq.load(path)["optimizer"]["state"][0]
    assert_same(obj["optimizer"]["state"][0]["exp_avg"], q["exp_avg"])
    dense = ckptq.load(path, dequantize=True)["optimizer"]["state"][0]
    assert torch.equal(dense["exp_avg_sq"], quant.dequantize_state(q["exp_avg_sq"]))
    assert dense["exp_avg_sq"].shape == (70, 70)
    # a ratio state comes back quantized with its divisor key, and decodes through its sibling
    r = ckptq.load(path)["optimizer"]["state"][1]
    assert_same(obj["optimizer"]["state"][1]["exp_avg"], r["exp_avg"])
    dense1 = ckptq.load(path, dequantize=True)["optimizer"]["state"][1]
    assert torch.equal(dense1["exp_avg"], quant.dequantize_states(r)["exp_avg"])
    for lazy_path in (str(tmp_path / "e.pt"),):  # and through the streaming expand
        ckptq.expand(path, lazy_path)
        assert torch.equal(torch.load(lazy_path, weights_only=True)["optimizer"]["state"][1]["exp_avg"], dense1["exp_avg"])


def test_stock_safe_open_reads_it_and_metadata_is_tagged(tmp_path):
    obj, _, _ = _qstate_obj()
    path = str(tmp_path / "q.safetensors")
    ckptq.save(obj, path)
    with safe_open(path, "pt") as f:
        meta = f.metadata()
        assert meta["format"] == "pt" and meta["ckptq.format"] == "ckptq" and meta["ckptq.version"] == "3"
        assert len(meta["ckptq.header_crc32"]) == 8
        codes = f.get_tensor("optimizer/state/0/exp_avg/codes")
    assert codes.dtype == torch.uint8 and codes.shape == (1, 5000)  # the row layout: a 1-D state is one row
    assert torch.equal(codes, obj["optimizer"]["state"][0]["exp_avg"]["codes"])


def _flip_byte(path, offset_from_end):
    with open(path, "r+b") as f:
        f.seek(-offset_from_end, os.SEEK_END)
        b = f.read(1)
        f.seek(-offset_from_end, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x40]))


def test_flipped_byte_names_the_tensor(tmp_path):
    obj, _, _ = _qstate_obj()
    path = str(tmp_path / "q.safetensors")
    ckptq.save(obj, path)
    _flip_byte(path, 100)
    with pytest.raises(ChecksumError, match="fails its checksum"):
        ckptq.load(path)
    ckptq.load(path, verify=False)  # the flag skips verification


def test_truncated_and_foreign_files_are_refused(tmp_path):
    obj, _, _ = _qstate_obj()
    path = str(tmp_path / "q.safetensors")
    ckptq.save(obj, path)
    data = open(path, "rb").read()
    (tmp_path / "t.safetensors").write_bytes(data[:-10])
    with pytest.raises(FormatError, match="truncated"):
        ckptq.load(str(tmp_path / "t.safetensors"))
    (tmp_path / "h.safetensors").write_bytes(data[:200])
    with pytest.raises(FormatError):
        ckptq.load(str(tmp_path / "h.safetensors"))
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(3)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(FormatError, match="not one written by ckptq"):
        ckptq.load(str(tmp_path / "plain.safetensors"))
    with pytest.raises(InputError, match="no such file"):
        ckptq.load(str(tmp_path / "missing.safetensors"))


def _rewrite_metadata(path, edit, reseal=True):
    """Edit a file's metadata in place and (by default) seal the header again, as a writer would."""
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header["__metadata__"])
    if reseal and integrity.KEY in header["__metadata__"]:
        header["__metadata__"][integrity.KEY] = integrity.PLACEHOLDER
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    raw = bytearray(struct.pack("<Q", len(head)) + head)
    if reseal and integrity.KEY in header["__metadata__"]:
        integrity.seal(raw)
    open(path, "wb").write(bytes(raw) + data[8 + n :])


def test_newer_version_and_unknown_bit_width_are_refused_clearly(tmp_path):
    obj, _, _ = _qstate_obj()
    path = str(tmp_path / "q.safetensors")
    ckptq.save(obj, path)
    _rewrite_metadata(path, lambda m: m.update({"ckptq.version": "4"}))
    with pytest.raises(FormatError, match="version '4'.*upgrade"):
        ckptq.load(path)
    ckptq.save(obj, path, force=True)

    def bits(width):
        return lambda m: m.update({"ckptq.skeleton": m["ckptq.skeleton"].replace('"bits":8', f'"bits":{width}')})

    _rewrite_metadata(path, bits(3))
    with pytest.raises(FormatError, match="3 bits.*cannot decode"):
        ckptq.load(path)
    ckptq.save(obj, path, force=True)
    _rewrite_metadata(path, bits(4))  # a width ckptq reads, but 8-bit-sized codes: damage, not a new format
    with pytest.raises(FormatError, match=r"names codes U8 \[1, 5000\], expected U8 \[1, 2500\]; the file is corrupt"):
        ckptq.load(path)


def test_existing_output_needs_force_and_failed_write_leaves_nothing(tmp_path):
    path = str(tmp_path / "x.safetensors")
    ckptq.save({"a": torch.ones(3)}, path)
    with pytest.raises(OutputExistsError):
        ckptq.save({"a": torch.zeros(3)}, path)
    assert torch.equal(ckptq.load(path)["a"], torch.ones(3))

    class Boom(torch.Tensor):
        pass

    from ckptq.codec import tree

    skeleton, stored = tree.flatten({"a": torch.ones(3), "b": torch.ones(4)})

    def fail():
        raise KeyboardInterrupt

    stored[1].produce = fail
    with pytest.raises(KeyboardInterrupt):
        format.write(str(tmp_path / "y.safetensors"), skeleton, stored, {})
    assert sorted(os.listdir(tmp_path)) == ["x.safetensors"]


def test_sharded_output_reads_from_index_folder_or_file(tmp_path):
    obj = {f"w{i}": torch.randn(1000) for i in range(6)}
    out = tmp_path / "shards"
    out.mkdir()
    paths = ckptq.save(obj, str(out / "m.q8.safetensors"), max_shard_size=9000)
    index = json.loads(open(paths[0]).read())
    assert paths[0].endswith(".safetensors.index.json") and len(paths) == 4
    assert set(index["weight_map"].values()) == {os.path.basename(p) for p in paths[1:]}
    assert index["metadata"]["total_size"] == 6 * 4000
    for src in (paths[0], str(out)):
        assert_same(obj, ckptq.load(src))


def _nesting(value) -> int:
    """How deeply lists and dicts nest in ``value``; iterative, so that it holds at any recursion limit."""
    deepest, todo = 0, [(value, 0)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, depth + 1)
            todo += [(x, depth + 1) for x in (v.values() if isinstance(v, dict) else v)]
    return deepest


_JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ab\n\u00e9'),
                            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                                st.text(alphabet='[]{}"\\a', max_size=4), inner, max_size=3), max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(_JSON_VALUES, st.booleans())
def test_json_depth_counts_brackets_outside_strings(value, as_bytes):
    """The reader's nesting pre-scan agrees with the parsed value, brackets, quotes and backslashes inside
    strings included (it decides what is refused before json's recursive parser runs)."""
    from ckptq.format.reader import json_depth

    text = json.dumps(value, ensure_ascii=False)
    assert json_depth(text.encode() if as_bytes else text) == _nesting(value)


def test_json_nesting_limit_holds_at_any_recursion_limit():
    from ckptq.format.reader import MAX_JSON_DEPTH, parse_json

    deepest = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    before = sys.getrecursionlimit()
    try:
        for limit in (before, 10_000):
            sys.setrecursionlimit(limit)
            assert _nesting(parse_json(deepest, "x")) == MAX_JSON_DEPTH
            with pytest.raises(FormatError, match=r"^x is corrupt \(arrays and objects nested more than 512 deep\)$"):
                parse_json("[" + deepest + "]", "x")
    finally:
        sys.setrecursionlimit(before)
