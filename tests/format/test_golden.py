"""The format is a public contract: checked-in version-1 and version-2 files must keep decoding to the
same object, writing the version-3 object (quantized states in the row layout) must give the version-3
file's bytes, and a decoder written from docs/FORMAT.md alone (json, numpy, safetensors.numpy, zlib) must
agree with ckptq's on every version.

Regenerate (only when the format deliberately changes, with a version bump): CKPTQ_REGEN_GOLDEN=1 pytest tests/format/test_golden.py
(this rewrites the newest version's file; older ones stay as they are, forever).
"""

import collections
import json
import os
import re
import struct
import zlib

import numpy as np
import pytest
import torch
from safetensors import safe_open

import ckptq
from ckptq.codec import codebooks, ops
from ckptq.codec.quant import count_qstates
from tests.format.test_format import assert_same
from tests.helpers import golden_roles, paths

GOLDEN_V1 = os.path.join(paths.GOLDEN, "v1.safetensors")
GOLDEN = os.path.join(paths.GOLDEN, "v2.safetensors")
GOLDEN_4BIT = os.path.join(paths.GOLDEN, "v2-4bit.safetensors")  # 4-bit states, version 2
GOLDEN_6_2 = os.path.join(paths.GOLDEN, "v2-6bit-2bit.safetensors")  # 6- and 2-bit states
GOLDEN_V3 = os.path.join(paths.GOLDEN, "v3-rows.safetensors")  # the row layout, every width
INFO = {"created_by": "golden"}


def _q(x, signed, transform, block_size, bits=8, qmap=None):
    if qmap is None:
        qmap = codebooks.dynamic_map(signed) if bits == 8 else codebooks.power_map(signed, 1.5 if signed else 3.0, 4)
    codes, absmax = ops.quantize_blockwise(x, qmap, block_size, transform, bits=bits)
    return {"ckptq": "blockwise", "bits": bits, "codes": codes, "absmax": absmax, "qmap": qmap,
            "block_size": block_size, "transform": transform, "shape": tuple(x.shape), "dtype": "float32"}


def golden_object():
    g = torch.Generator().manual_seed(1234)
    emb = torch.randn(16, 8, generator=g)
    model = collections.OrderedDict([("wte.weight", emb), ("head.weight", emb),
                                     ("ln.bias", torch.zeros(8, dtype=torch.bfloat16)),
                                     ("pos", torch.arange(6, dtype=torch.int64).view(2, 3).t())])
    model._metadata = collections.OrderedDict([("", {"version": 1})])
    m = torch.randn(300, generator=g) * 1e-3
    v = (torch.randn(20, 15, generator=g) * 1e-2) ** 2
    m2 = torch.randn(20, 15, generator=g) * v.sqrt()
    ratio = _q(m2 / (v.sqrt() + 1e-9), True, "none", 64) | {"transform": "ratio", "eps": 1e-9, "divisor": "exp_avg_sq"}
    state = {0: {"step": torch.tensor(7.0), "exp_avg": _q(m, True, "none", 64), "exp_avg_sq": _q(v, False, "sqrt", 64)},
             2: {"step": torch.tensor(7.0), "exp_avg": ratio, "exp_avg_sq": _q(v, False, "sqrt", 64)},
             1: {"step": torch.tensor(7.0), "exp_avg": torch.ones(3), "exp_avg_sq": torch.full((3,), 0.5)}}
    groups = [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
               "foreach": None, "params": [0]},
              {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
               "foreach": None, "params": [1, 2]}]
    return {"model": model, "optimizer": {"state": state, "param_groups": groups}, "iter_num": 7,
            "best_val_loss": torch.tensor(2.5), "config": {"name": "golden", "dropout": 0.0, "nan": float("nan")}}


def golden_object_4bit():
    """4-bit states: odd element counts (the last byte holds one code), a plain, a sqrt and a ratio state."""
    g = torch.Generator().manual_seed(4)
    m = torch.randn(301, generator=g) * 1e-3
    v = (torch.randn(19, 15, generator=g) * 1e-2) ** 2
    m2 = torch.randn(19, 15, generator=g) * v.sqrt()
    ratio = _q(m2 / (v.sqrt() + 1e-9), True, "none", 64, 4) | {"transform": "ratio", "eps": 1e-9, "divisor": "exp_avg_sq"}
    state = {0: {"step": torch.tensor(3.0), "exp_avg": _q(m, True, "none", 128, 4),
                 "exp_avg_sq": _q(m * m, False, "sqrt", 128, 4)},
             1: {"step": torch.tensor(3.0), "exp_avg": ratio, "exp_avg_sq": _q(v, False, "sqrt", 64, 4)}}
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False, "params": [0, 1]}]
    return {"optimizer": {"state": state, "param_groups": groups}}


def golden_object_6_2bit():
    """What ``convert --bits 4`` writes: a 6-bit ratio over a 2-bit sqrt second moment, 301 and 285
    elements (the last byte part full); the second parameter's state in blocks of 128."""
    g = torch.Generator().manual_seed(6)
    state = {}
    for pid, (shape, block) in enumerate((((301,), 64), ((19, 15), 128))):
        v = (torch.randn(shape, generator=g) * 1e-2) ** 2
        m = torch.randn(shape, generator=g) * v.sqrt()
        ratio = _q(m / (v.sqrt() + 1e-9), None, "none", block, 6, codebooks.lloyd_gaussian_map_6bit())
        state[pid] = {"step": torch.tensor(5.0), "exp_avg": ratio | {"transform": "ratio", "eps": 1e-9,
                                                                     "divisor": "exp_avg_sq"},
                      "exp_avg_sq": _q(v, None, "sqrt", block, 2, codebooks.geometric_map())}
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False, "params": [0, 1]}]
    return {"optimizer": {"state": state, "param_groups": groups}}


def golden_object_v3():
    """Version 3: states in the row layout, rows that are not whole blocks (15 in blocks of 64, 150 in blocks
    of 128: 128 + 22, 201 in blocks of 64: 3 x 64 + 9), a 1-D state (one row), and every width: an 8-bit
    ratio over 8-bit sqrt(v), 4-bit plain and sqrt states, a 6-bit ratio over a 2-bit sqrt(v) with
    amsgrad's 4-bit max_exp_avg_sq (odd rows: the last byte of a row part full)."""
    from ckptq.codec import quant

    g = torch.Generator().manual_seed(3)
    v8 = (torch.randn(20, 15, generator=g) * 1e-2) ** 2
    m8 = torch.randn(20, 15, generator=g) * v8.sqrt()
    m4, v4 = torch.randn(19, 150, generator=g) * 1e-3, (torch.randn(19, 150, generator=g) * 1e-2) ** 2
    v62 = (torch.randn(7, 201, generator=g) * 1e-2) ** 2
    m62 = torch.randn(7, 201, generator=g) * v62.sqrt()
    flat = torch.randn(301, generator=g) * 1e-3
    state = {0: {"step": torch.tensor(7.0), "exp_avg": quant.quantize_ratio(m8, v8, 1e-9, 64, "torch"),
                 "exp_avg_sq": quant.quantize_state(v8, "exp_avg_sq", 64, "torch")},
             1: {"step": torch.tensor(7.0), "exp_avg": quant.quantize_state(m4, "exp_avg", 128, "torch", 4),
                 "exp_avg_sq": quant.quantize_state(v4, "exp_avg_sq", 128, "torch", 4)},
             2: {"step": torch.tensor(7.0), "exp_avg": quant.quantize_ratio(m62, v62, 1e-9, 64, "torch", bits=6),
                 "exp_avg_sq": quant.quantize_state(v62, "exp_avg_sq", 64, "torch", 2),
                 "max_exp_avg_sq": quant.quantize_state(v62 * 1.5, "max_exp_avg_sq", 64, "torch", 4)},
             3: {"step": torch.tensor(7.0), "exp_avg": quant.quantize_state(flat, "exp_avg", 64, "torch"),
                 "exp_avg_sq": quant.quantize_state(flat * flat, "exp_avg_sq", 64, "torch")}}
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
               "params": [0, 1, 2, 3]}]
    return {"optimizer": {"state": state, "param_groups": groups}}


def test_golden_file_is_pinned(tmp_path):
    if os.environ.get("CKPTQ_REGEN_GOLDEN"):
        ckptq.save(golden_object_v3(), GOLDEN_V3, info=INFO, force=True)
    out = str(tmp_path / "again.safetensors")
    ckptq.save(golden_object_v3(), out, info=INFO)
    assert open(out, "rb").read() == open(GOLDEN_V3, "rb").read(), "the writer's bytes changed: that is a format change"
    assert json.loads(safe_open(GOLDEN_V3, "np").metadata()["ckptq.version"]) == 3
    assert_same(golden_object_v3(), ckptq.load(GOLDEN_V3))


@pytest.mark.parametrize("path,build", [(GOLDEN, golden_object), (GOLDEN_4BIT, golden_object_4bit),
                                        (GOLDEN_6_2, golden_object_6_2bit)])
def test_version_2_files_still_load_exactly(path, build):
    assert json.loads(safe_open(path, "np").metadata()["ckptq.version"]) == 2
    assert_same(build(), ckptq.load(path))


def test_version_1_file_still_loads_exactly():
    assert json.loads(safe_open(GOLDEN_V1, "np").metadata()["ckptq.version"]) == 1
    assert_same(golden_object(), ckptq.load(GOLDEN_V1))
    assert_same(ckptq.load(GOLDEN, dequantize=True), ckptq.load(GOLDEN_V1, dequantize=True))


def test_third_party_header_checksum_agrees():
    """docs/FORMAT.md: crc32 of the first 8 + N bytes with the checksum's 8 digits set to '0'."""
    data = open(GOLDEN, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    head = data[: 8 + n]
    recorded = json.loads(head[8:])["__metadata__"]["ckptq.header_crc32"]
    zeroed = re.sub(rb'"ckptq.header_crc32":"[0-9a-f]{8}"', b'"ckptq.header_crc32":"00000000"', head)
    assert f"{zlib.crc32(zeroed):08x}" == recorded


def _numpy_values(path, q):
    """qmap[codes] * absmax[block], fp32, flat (docs/FORMAT.md section 5)."""
    bits = q["bits"]
    assert q["codec"] == "blockwise" and bits in (8, 6, 4, 2)
    with safe_open(path, "np") as f:
        codes, absmax, qmap = (f.get_tensor(q[k]) for k in ("codes", "absmax", "qmap"))
    shape = q["shape"]
    n = int(np.prod(shape))
    if q.get("layout", "flat") == "rows":  # section 5: each row is a flat run of its own
        rows, length = (shape[0], n // shape[0]) if len(shape) >= 2 else (1, n)
        assert codes.shape == (rows, (length * bits + 7) // 8) and absmax.shape[0] == rows
        return np.concatenate([_flat_values(codes[r], absmax[r], qmap, length, bits, q["block_size"])
                               for r in range(rows)])
    return _flat_values(codes, absmax, qmap, n, bits, q["block_size"])


def _flat_values(codes, absmax, qmap, n, bits, block_size):
    """One run of n codes in blocks of ``block_size``, each block times its scale."""
    assert qmap.shape == (2**bits,) and codes.shape == ((n * bits + 7) // 8,)
    if bits != 8:  # element i: bits [i * bits, (i + 1) * bits) of the little-endian bit stream
        stream = np.unpackbits(codes, bitorder="little")
        assert not stream[n * bits :].any()  # the bits after the last code are 0
        codes = (stream[: n * bits].reshape(n, bits).astype(np.int64) << np.arange(bits)).sum(axis=1)
    return qmap[codes].astype(np.float32) * np.repeat(absmax, block_size)[:n]


def _numpy_decode(path, node, siblings):
    """Decode a quantized node using only the spec."""
    q = node["quantized"]
    y = _numpy_values(path, q)
    if q["transform"] == "sqrt":
        y = y * y
    elif q["transform"] == "ratio":
        s = _numpy_values(path, siblings[q["divisor"]]["quantized"])  # the divisor's sqrt-domain value
        y = y * (s + np.float32(q["eps"]))
    return y.reshape(q["shape"])


def _find(node, key):
    for k, v in node.get("dict", []) + node.get("odict", []):
        if k == key:
            return v
    raise KeyError(key)


@pytest.mark.parametrize("golden,pid,role", [(g, pid, role) for g in (GOLDEN_V1, GOLDEN) for pid in (0, 2)
                                              for role in ("exp_avg", "exp_avg_sq")]
                         + [(g, pid, role) for g in (GOLDEN_4BIT, GOLDEN_6_2) for pid in (0, 1)
                            for role in ("exp_avg", "exp_avg_sq")]
                         + [(GOLDEN_V3, pid, role) for pid in (0, 1, 2, 3) for role in ("exp_avg", "exp_avg_sq")]
                         + [(GOLDEN_V3, 2, "max_exp_avg_sq")])
def test_third_party_decoder_agrees(pid, role, golden):
    with safe_open(golden, "np") as f:
        skeleton = json.loads(f.metadata()["ckptq.skeleton"])
    pstate = _find(_find(_find(skeleton, "optimizer"), "state"), pid)
    siblings = {k: v for k, v in pstate["dict"]}
    ours = ckptq.load(golden, dequantize=True)["optimizer"]["state"][pid][role]
    assert np.array_equal(_numpy_decode(golden, siblings[role], siblings), ours.numpy())


@pytest.mark.parametrize("name", sorted(golden_roles.OPTIMIZERS))
def test_role_golden_files_are_pinned(tmp_path, name):
    """Per optimizer, what convert writes for its roles at 8 and 4 bits: the writer's bytes, and the object."""
    path, obj = golden_roles.path(name), golden_roles.golden_object(name)
    if os.environ.get("CKPTQ_REGEN_GOLDEN"):
        ckptq.save(obj, path, info=INFO, force=True)
    out = str(tmp_path / "again.safetensors")
    ckptq.save(golden_roles.golden_object(name), out, info=INFO)
    assert open(out, "rb").read() == open(path, "rb").read(), "the writer's bytes changed: that is a format change"
    assert count_qstates(ckptq.load(path)) >= 2
    dense = ckptq.load(path, dequantize=True)
    with safe_open(path, "np") as f:
        skeleton = json.loads(f.metadata()["ckptq.skeleton"])
    assert _numpy_walk(path, skeleton, dense) == count_qstates(ckptq.load(path))


def _numpy_walk(path, node, obj) -> int:
    """Decode every quantized node of a skeleton with the spec-only decoder; it must equal ckptq's values."""
    n = 0
    if isinstance(node, dict) and ("dict" in node or "odict" in node):
        items = node.get("dict", node.get("odict"))
        siblings = {k: v for k, v in items if not isinstance(k, dict)}
        for k, v in items:
            if isinstance(v, dict) and "quantized" in v:
                assert np.array_equal(_numpy_decode(path, v, siblings), obj[k].numpy()), k
                n += 1
            elif not isinstance(k, dict):
                n += _numpy_walk(path, v, obj[k])
    elif isinstance(node, dict) and "list" in node:
        n += sum(_numpy_walk(path, v, o) for v, o in zip(node["list"], obj))
    return n
