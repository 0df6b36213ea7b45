"""Hostile inputs: damaged and crafted files. Every one must give a one-line FormatError/InputError,
never a traceback, a hang, a partial output or silently wrong data (helpers in hostile.py)."""

import json
import os
import shutil
import struct
import subprocess
import sys
import tracemalloc

import pytest
import torch

import ckptq
from ckptq.format import compress, integrity
from ckptq.errors import CkptqError, FormatError, InputError
from tests.helpers.hostile import (KINDS, edit_skeleton, make_set, mutation_campaign, resealed_campaign, rewrite,
                     write_index)
from tests.helpers.paths import GOLDEN, child_env


def refused(path, match=None, cls=FormatError, tmp=None):
    """load, load(dequantize=True) and expand all refuse ``path`` in one line; expand writes nothing."""
    out = os.path.join(tmp or os.path.dirname(path), "out.pt")
    for call in (lambda: ckptq.load(path), lambda: ckptq.load(path, dequantize=True),
                 lambda: ckptq.expand(path, out)):
        with pytest.raises(cls, match=match) as e:
            call()
        assert "\n" not in str(e.value)
    assert not os.path.exists(out)


def test_bit_flip_and_truncation_campaign_has_no_traceback_no_hang_and_no_wrong_result(tmp_path):
    """120 damaged copies of each kind, in a child process with a time limit: a hang fails the test."""
    code = (f"import json; from tests.helpers import hostile; "
            f"print(json.dumps(hostile.campaign(120, 2024, workdir={str(tmp_path)!r})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
    # env: the checkout on PYTHONPATH, so that the child imports tests.helpers whatever its cwd
                       env=child_env())
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.splitlines()[-1])
    examples = res.pop("examples")
    assert not examples, examples[:5]
    for kind in KINDS:
        assert res[kind].get("refused", 0) + res[kind].get("same", 0) == 120, res
        assert res[kind].get("refused", 0) > 100, res  # the campaign does damage what it tests


def test_crafted_headers_campaign_has_no_traceback(tmp_path):
    res = resealed_campaign(trials=100, seed=7, workdir=str(tmp_path))
    assert res["examples"] == [] and res.get("traceback", 0) == 0, res["examples"][:5]
    assert res["refused"] > 100, res


def test_mutated_structure_campaign_has_no_traceback(tmp_path):
    """Values of other types (or dropped keys) anywhere in header, table, skeleton or index, re-sealed."""
    res = mutation_campaign(trials=150, seed=11, workdir=str(tmp_path))
    assert res["examples"] == [] and res.get("traceback", 0) == 0, res["examples"][:5]
    assert res["refused"] > 300, res


@pytest.fixture
def plain(tmp_path):
    return make_set(str(tmp_path), "plain")


SKELETON_EDITS = {
    "stride out of bounds": ('"offset": 0, "stride": [1, 3]', '"offset": 0, "stride": [1, 30]', "reaches element"),
    "negative stride": ('"offset": 0, "stride": [1, 3]', '"offset": 0, "stride": [1, -3]', "invalid stride"),
    "huge offset": ('"offset": 0, "stride": [1, 3]', '"offset": 1000000000000, "stride": [1, 3]', "reaches element"),
    # views that torch.save writes but torch.load cannot read back
    "stride 2**70": ('"offset": 0, "stride": [1, 3]', '"offset": 0, "stride": [1, 1180591620717411303424]', "invalid stride"),
    "offset 2**70 of an empty view": ('"shape": [3, 2], "data": "model/pos", "offset": 0, "stride": [1, 3]',
                                      '"shape": [0, 2], "data": "model/pos", "offset": 1180591620717411303424, "stride": [1, 3]',
                                      "invalid stride"),
    "offset past the storage of an empty view": ('"shape": [3, 2], "data": "model/pos", "offset": 0, "stride": [1, 3]',
                                                 '"shape": [0, 2], "data": "model/pos", "offset": 7, "stride": [1, 3]',
                                                 "reaches element"),
    "device cuda:999": ('{"device": "cpu"}', '{"device": "cuda:999"}', "cannot read back"),
    "unknown dtype name": ('"transform": "sqrt", "dtype": "float32"', '"transform": "sqrt", "dtype": "Tensor"', "dtype"),
    "integer state dtype": ('"transform": "sqrt", "dtype": "float32"', '"transform": "sqrt", "dtype": "int64"', "not a float"),
    "missing data": ('"shape": [8], "data": "model/bias"', '"shape": [8]', "fields"),
    "whole tensor of another dtype": ('"dtype": "bfloat16", "shape": [8]', '"dtype": "float16", "shape": [8]', "stored as BF16"),
    "whole tensor too big": ('"shape": [8], "data": "model/bias"', '"shape": [4096], "data": "model/bias"', "needs"),
    "codes of another size": ('"dtype": "float32", "eps": 1e-09, "divisor": "exp_avg_sq", "shape": [20, 15]',
                              '"dtype": "float32", "eps": 1e-09, "divisor": "exp_avg_sq", "shape": [20, 16]', "expected U8"),
    "string eps": ('"eps": 1e-09', '"eps": "1e-09"', "finite eps"),
    "no divisor": ('"divisor": "exp_avg_sq"', '"divisor": "nope"', "divisor"),
    "bad float": ('{"float": "nan"}', '{"float": "nax"}', "not a float"),
    "unknown kind": ('{"size": [2, 3]}', '{"sizes": [2, 3]}', "unknown kind"),
    "unhashable key": ('[["name", "x"]', '[[{"list": []}, "x"]', "unhashable"),
    "extra field": ('{"device": "cpu"}', '{"device": "cpu", "x": 1}', "fields"),
}


@pytest.mark.parametrize("case", sorted(SKELETON_EDITS))
def test_crafted_skeleton_is_refused_before_anything_is_written(case, plain):
    old, new, match = SKELETON_EDITS[case]

    def edit(sk):
        text = json.dumps(sk)
        assert old in text
        return json.loads(text.replace(old, new, 1))

    edit_skeleton(plain, edit)
    refused(plain, match)


@pytest.mark.parametrize("recursion_limit", [None, 5000])
def test_deeply_nested_skeleton_is_one_line(plain, recursion_limit):
    """200 lists (400 JSON levels) parse and reach the skeleton's own limit; 500 (1,000 levels) are refused
    before parsing, with the same message whatever the recursion limit (torch's inductor raises it to
    2,000, and json then parsed what it refused before: the message depended on which tests ran first)."""
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(recursion_limit or before)
    try:
        for levels, match in ((200, r"skeleton node (/list/0)+/ is nested more than 100 deep; the file is corrupt$"),
                              (500, r"the skeleton is corrupt \(arrays and objects nested more than 512 deep\)$")):
            edit_skeleton(plain, lambda sk: '{"list": [' * levels + "null" + "]}" * levels)
            refused(plain, match)
    finally:
        sys.setrecursionlimit(before)


@pytest.mark.parametrize("version,match", [("01", "version '01'"), ("\u0661", "version"), ("2 ", "version"),
                                           (2, "str->str"), (None, "str->str")])
def test_version_must_be_plain_ascii_digits(version, match, plain):
    rewrite(plain, lambda h: h["__metadata__"].update({"ckptq.version": version}))
    refused(plain, match)


def test_zero_byte_entry_with_a_shape_is_refused(tmp_path):
    path = str(tmp_path / "z.safetensors")
    ckptq.save({"a": torch.zeros(0)}, path)

    def grow(h):
        h["a"]["shape"] = [4096]
        table = json.loads(h["__metadata__"]["ckptq.tensors"])
        table["a"]["shape"] = [4096]
        h["__metadata__"]["ckptq.tensors"] = json.dumps(table)
        edit = json.loads(h["__metadata__"]["ckptq.skeleton"])
        edit["dict"][0][1]["tensor"]["shape"] = [4096]
        h["__metadata__"]["ckptq.skeleton"] = json.dumps(edit)

    rewrite(path, grow)
    refused(path, "0 bytes")


@pytest.mark.parametrize("golden", ["v1", "v2"])
@pytest.mark.parametrize("damage", ["no crc32", "no table", "extra row"])
def test_every_entry_needs_a_checksummed_table_row(damage, golden, tmp_path):
    path = str(tmp_path / "g.safetensors")
    shutil.copy(os.path.join(GOLDEN, f"{golden}.safetensors"), path)

    def edit(h):
        meta = h["__metadata__"]
        table = json.loads(meta["ckptq.tensors"])
        if damage == "no crc32":
            for row in table.values():
                del row["crc32"]
        elif damage == "extra row":
            table["ghost"] = dict(next(iter(table.values())))
        meta["ckptq.tensors"] = json.dumps(table)
        if damage == "no table":
            del meta["ckptq.tensors"]

    rewrite(path, edit)
    refused(path, "table")


@pytest.mark.parametrize("where", ["entry", "table"])
def test_unhashable_dtype_in_header_is_one_line(where, plain):
    def edit(h):
        if where == "entry":
            h["model/big"]["dtype"] = ["F32"]
        else:
            table = json.loads(h["__metadata__"]["ckptq.tensors"])
            table["model/big"]["dtype"] = {"F32": 1}
            h["__metadata__"]["ckptq.tensors"] = json.dumps(table)

    rewrite(plain, edit)
    refused(plain, "malformed|no valid row")


def test_unsealed_version_2_header_is_refused(plain):
    rewrite(plain, lambda h: h["__metadata__"].pop(integrity.KEY))
    refused(plain, "no ckptq.header_crc32")


def _sharded(folder, seed):
    obj = {f"w{i}": torch.full((500,), float(seed + i)) for i in range(4)}
    return ckptq.save(obj, os.path.join(folder, "m.safetensors"), max_shard_size=2100)


def test_a_set_mixing_shards_of_two_writes_is_refused(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = _sharded(str(tmp_path / "a"), 0), _sharded(str(tmp_path / "b"), 10)
    assert len(a) == 5
    shutil.copy(b[2], a[2])  # what a crash between the renames of an overwrite leaves
    refused(a[0], "not the one this index was written with")


def test_a_shard_opened_alone_says_to_open_the_index(tmp_path):
    paths = _sharded(str(tmp_path), 0)
    refused(paths[1], "shard 1/4 of a set: open the set's .safetensors.index.json")


@pytest.mark.parametrize("name", ["ABS", "../b/m-00001-of-00004.safetensors", "", ".", None, 3])
def test_index_names_only_files_in_its_folder(name, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = _sharded(str(tmp_path / "a"), 0), _sharded(str(tmp_path / "b"), 0)
    index = json.loads(open(a[0]).read())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = b[1] if name == "ABS" else name
    write_index(a[0], index)
    refused(a[0], "only name files in its own folder")


def test_fifos_never_hang_any_command(tmp_path):
    """A FIFO as input to convert, expand, info, load, or named as a shard: a one-line InputError."""
    os.mkfifo(tmp_path / "fifo.safetensors")
    os.mkfifo(tmp_path / "fifo.pt")
    (tmp_path / "s").mkdir()
    paths = _sharded(str(tmp_path / "s"), 0)
    os.unlink(paths[2])
    os.mkfifo(paths[2])
    script = f"""
import ckptq
from ckptq.errors import InputError
fifo, pt, index = {str(tmp_path / "fifo.safetensors")!r}, {str(tmp_path / "fifo.pt")!r}, {paths[0]!r}
calls = [lambda: ckptq.convert(pt), lambda: ckptq.convert(fifo), lambda: ckptq.expand(fifo, fifo + ".pt"),
         lambda: ckptq.info(fifo), lambda: ckptq.info(pt), lambda: ckptq.load(fifo),
         lambda: ckptq.load(index), lambda: ckptq.expand(index, index + ".pt")]
for call in calls:
    try:
        call()
        print("LOADED")
    except InputError as e:
        print("REFUSED", e)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 8 and all(ln.startswith("REFUSED") for ln in lines), r.stdout + r.stderr
    assert all("FIFO" in ln for ln in lines), lines


def _bomb_frame(declared: int) -> bytes:
    """A 15-byte zstd frame whose header declares ``declared`` bytes of content (one empty raw block)."""
    return struct.pack("<IB", 0xFD2FB528, 0xE0) + struct.pack("<Q", declared) + b"\x01\x00\x00"


def _write_compressed(path, payload_for, monkeypatch):
    real = compress.compress

    def fake(t, level=3, threads=0, chunk_bytes=compress.DEFAULT_CHUNK_BYTES):
        return payload_for(t) if t.numel() == 1024 else real(t, level, threads, chunk_bytes)

    with monkeypatch.context() as m:
        m.setattr(compress, "compress", fake)
        ckptq.save({"big": torch.zeros(1024)}, path, compression=ckptq.format.Compression(3, 1))


@pytest.mark.parametrize("case", ["frame declares 2 GB", "table declares 2 GB", "chunk of 2 GB"])
def test_decompression_bomb_is_refused_before_allocating(case, tmp_path, monkeypatch):
    path = str(tmp_path / "bomb.safetensors")
    n = 1024 if case != "chunk of 2 GB" else 2**29
    params = {"codec": "bgzstd", "version": 1, "elem_bytes": 4, "chunk_elems": n, "transform": "rotl1"}
    segs = [_bomb_frame(2**31)] + [b"\0" * 1024] * 3

    def payload(t):
        table = struct.pack("<4Q", *map(len, segs)) + bytes([1, 0, 0, 0])
        return table + b"".join(segs), params

    _write_compressed(path, payload, monkeypatch)
    if case != "frame declares 2 GB":
        def grow(h):
            table = json.loads(h["__metadata__"]["ckptq.tensors"])
            table["big"]["shape"] = [2**29]
            h["__metadata__"]["ckptq.tensors"] = json.dumps(table)
            if case == "chunk of 2 GB":
                h["__metadata__"]["ckptq.skeleton"] = h["__metadata__"]["ckptq.skeleton"].replace("[1024]", f"[{2**29}]")
        rewrite(path, grow)
    tracemalloc.start()
    try:
        refused(path, "declares|needs|chunk_elems")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 << 20, peak


def test_damaged_files_from_info_are_one_line_too(plain):
    with open(plain, "r+b") as f:
        f.seek(100)
        f.write(b"#")
    with pytest.raises(CkptqError) as e:
        ckptq.info(plain)
    assert "\n" not in str(e.value)


def test_inputs_that_are_folders_or_missing_are_input_errors(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        ckptq.load(str(tmp_path / "missing.safetensors"))
    with pytest.raises(InputError, match="folder"):
        ckptq.convert(str(tmp_path))


def test_a_none_key_beside_a_quantized_state_round_trips(tmp_path):
    """A non-ratio state has no divisor: decoding must not look up the sibling keyed None."""
    from tests.helpers.hostile import _q

    state = {"exp_avg": _q(torch.randn(300), True, "none"), None: torch.ones(3)}
    path = str(tmp_path / "n.safetensors")
    ckptq.save({"s": state}, path)
    back = ckptq.load(path, dequantize=True)["s"]
    assert back[None].tolist() == [1.0, 1.0, 1.0] and back["exp_avg"].shape == (300,)
    ckptq.expand(path, str(tmp_path / "n.pt"))


def test_a_flip_anywhere_in_the_header_is_reported_as_a_header_checksum_failure(plain):
    from ckptq.errors import ChecksumError

    (n,) = struct.unpack("<Q", open(plain, "rb").read(8))
    with open(plain, "r+b") as f:  # the last byte of the header: padding, or the JSON's closing brace
        f.seek(8 + n - 1)
        b = f.read(1)[0]
        f.seek(8 + n - 1)
        f.write(bytes([b ^ 0x01]))
    refused(plain, "the header .* fails its checksum", ChecksumError)


@pytest.mark.parametrize("dtype", [torch.qint8, torch.quint8, torch.qint32])
def test_tensors_ckptq_could_not_read_back_are_refused_before_writing(tmp_path, dtype):
    """A qint8 moment: convert exited 0 and ckptq's own reader then called the output corrupt."""
    import warnings

    from click.testing import CliRunner
    from ckptq.cli import main

    q = torch.quantize_per_tensor(torch.randn(64, 128), 0.1, 0 if dtype != torch.qint32 else 0, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save({"optimizer": {"state": {0: {"step": torch.tensor(1.0), "exp_avg": q, "exp_avg_sq": torch.rand(64, 128)}},
                                  "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "params": [0]}]}},
                   tmp_path / "q.pt")
        r = CliRunner().invoke(main, ["convert", str(tmp_path / "q.pt")], catch_exceptions=False)
    assert r.exit_code == 2 and "writes nothing it could not read back" in r.output, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.pt"]
