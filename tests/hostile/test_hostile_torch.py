"""Hostile torch.save files (zip records, pickled state, views): what ckptq reads is what a strict torch.load
reads, or it refuses in one line; nothing it writes holds more than the input's bytes back."""

import json
import os
import subprocess
import sys
import zipfile

import pytest
import torch
from click.testing import CliRunner

from ckptq.cli import main
from ckptq.format import torch_zip
from tests.helpers.hostile import Shadowed
from tests.helpers.hostile_torch import TORCH_KINDS, _record_edit, clean_object
from tests.helpers.paths import child_env


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def _data_record(path, name_part):
    with zipfile.ZipFile(path) as z:
        return next(i for i in z.infolist() if i.filename.endswith(name_part))


def test_a_short_record_is_refused_and_replace_keeps_the_original(tmp_path):
    """data/0 cut to 16 bytes: a mapped load read the next records as its data, convert exited 0 and
    --replace deleted the original after comparing the garbage with itself."""
    src = tmp_path / "ckpt.pt"
    torch.save(clean_object(), src)
    _record_edit(str(src), __import__("random").Random(0), "truncate")
    before = src.read_bytes()
    for args in (["info", src], ["convert", src, "--replace"], ["expand", src, "-o", tmp_path / "x.pt"]):
        r = cli(*args)
        assert r.exit_code == 3 and len(r.output.strip().splitlines()) == 1, r.output
        assert "a strict torch.load refuses it too" in r.output
    assert src.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


def test_replace_compares_with_what_a_strict_load_reads(tmp_path):
    """A flipped byte inside a record (sizes intact): torch.load reads it without a word (no load checks
    the records' CRC-32), so --replace, which deletes the original, checks every record's CRC-32 first:
    the original is kept and the output removed."""
    src = tmp_path / "ckpt.pt"
    torch.save(clean_object(), src)
    rec = _data_record(src, "data/0")
    raw = bytearray(src.read_bytes())
    with open(src, "rb") as f:
        at = torch_zip._data_offset(f, rec) + 5  # inside the record's data (the local header pads to 64 bytes)
    raw[at] ^= 0x40
    src.write_bytes(bytes(raw))
    torch.load(src, weights_only=True)  # reads the damaged record as data
    assert cli("convert", src, "-o", tmp_path / "plain.q8.safetensors").exit_code == 0  # as torch does
    (tmp_path / "plain.q8.safetensors").unlink()
    r = cli("convert", src, "--replace")
    assert r.exit_code != 0 and "checksum" in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert src.read_bytes() == bytes(raw) and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


def test_a_state_dict_whose_pickled_state_hides_its_entries_is_refused(tmp_path):
    """An OrderedDict whose BUILD state shadows items(): ckptq saw an empty model (and wrote one), torch's
    consumers saw the weights."""
    obj = clean_object()
    weights = list(obj["model"].items())
    obj["model"] = Shadowed(weights, {"items": set, "_metadata": obj["model"]._metadata})
    torch.save(obj, tmp_path / "ckpt.pt")
    assert len(dict.items(torch.load(tmp_path / "ckpt.pt", weights_only=True)["model"])) == len(weights)
    for args in (["info", tmp_path / "ckpt.pt"], ["convert", tmp_path / "ckpt.pt"]):
        r = cli(*args)
        assert r.exit_code == 3 and "shadow its own methods" in r.output and len(r.output.splitlines()) == 1, r.output


def test_honest_state_dict_attributes_still_load(tmp_path):
    """``_metadata`` on a state dict and a library's own tag on a Parameter shadow nothing."""
    obj = clean_object()
    p = torch.nn.Parameter(torch.randn(4, 4))
    p._is_hf_initialized = True
    obj["model"]["tagged"] = p
    torch.save(obj, tmp_path / "ckpt.pt")
    assert cli("convert", tmp_path / "ckpt.pt").exit_code == 0


@pytest.mark.parametrize("numel", [2**28, 2**40])
def test_stride0_moments_are_kept_exact_not_multiplied(tmp_path, numel):
    """``torch.zeros(1).expand(2**28)`` as a moment: a 35 KB input gave a 545 MB output; at 2**40 info
    tried a 4 TiB allocation."""
    obj = clean_object()
    state = obj["optimizer"]["state"][0]
    state["exp_avg"], state["exp_avg_sq"] = torch.zeros(1).expand(numel), torch.ones(1).expand(numel)
    torch.save(obj, tmp_path / "ckpt.pt")
    r = cli("info", tmp_path / "ckpt.pt")
    assert r.exit_code == 0 and "repeats its bytes" in r.output, r.output
    assert cli("convert", tmp_path / "ckpt.pt", "-o", tmp_path / "q8.safetensors").exit_code == 0
    assert os.path.getsize(tmp_path / "q8.safetensors") < os.path.getsize(tmp_path / "ckpt.pt")
    assert cli("expand", tmp_path / "q8.safetensors", "-o", tmp_path / "back.pt").exit_code == 0
    back = torch.load(tmp_path / "back.pt", weights_only=True)["optimizer"]["state"][0]["exp_avg"]
    assert back.shape == (numel,) and back.stride() == (0,)


def test_torch_file_campaign_refuses_records_and_shadows_and_bounds_every_output(tmp_path):
    """25 crafted files per kind (zip records cut, extended, compressed, doubled, dropped or aliased;
    pickled state shadowing methods; views repeating their bytes), in a child with a memory limit: no
    traceback, no hang, records and shadows refused by every command, no output beyond the input's bytes."""
    code = ("import json, resource, warnings; from tests.helpers import hostile_torch; "
            "resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30)); warnings.filterwarnings('ignore'); "
            f"print(json.dumps(hostile_torch.torch_campaign(25, 2026, {str(tmp_path)!r})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
    # env: the checkout on PYTHONPATH, so that the child imports tests.helpers whatever its cwd
                       env=child_env())
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.splitlines()[-1])
    assert res.pop("examples") == []
    assert res["records"] == {"refused": 25} and res["shadow"] == {"refused": 25}, res
    assert sum(res["views"].values()) == 25 and set(res["views"]) <= {"refused", "loaded"}, res
    assert set(res) == set(TORCH_KINDS)


_KEYS = ["bad\nkey", "\x1b[2J\x1b[31mEVIL", "tab\there\r", "rtl\u202eoverride", "x\ud800y"]


@pytest.mark.parametrize("key", _KEYS)
def test_names_are_printed_escaped_on_one_line(tmp_path, key):
    """A key holding a newline gave a two-line error; an optimizer key with ESC sequences was printed raw
    by info on a terminal; a lone surrogate was an internal error (exit 70)."""
    obj = clean_object()
    state = obj["optimizer"]["state"]
    state[key] = state.pop(0)
    state[key]["exp_avg"][0, 0] = float("nan")  # a warning that names the state
    obj["optimizer"]["param_groups"][0]["params"] = [key if p == 0 else p for p in obj["optimizer"]["param_groups"][0]["params"]]
    obj["model"][key] = torch.ones(2)
    torch.save(obj, tmp_path / "ckpt.pt")
    for args in (["info", tmp_path / "ckpt.pt"], ["convert", tmp_path / "ckpt.pt"]):
        r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
        assert r.exit_code in (0, 2) and "internal error" not in r.output, r.output
        assert key not in r.output and not any(c in r.output for c in key if not c.isprintable() and c != "\n"), \
            repr(r.output)
        if r.exit_code:
            assert len(r.output.strip().splitlines()) == 1, r.output
        else:
            assert key.encode("unicode_escape", "backslashreplace").decode()[:6] in r.output, r.output


def test_a_lightning_checkpoint_with_ckptq_states_but_no_optimizer_states_is_refused(tmp_path):
    obj = clean_object()
    torch.save({"epoch": 0, "state_dict": obj["model"], "ckptq_optimizer_states": [obj["optimizer"]]}, tmp_path / "x.ckpt")
    for args in (["info", tmp_path / "x.ckpt"], ["expand", tmp_path / "x.ckpt", "-o", tmp_path / "y.ckpt"]):
        r = cli(*args)
        assert r.exit_code == 3 and "no optimizer_states list" in r.output and len(r.output.splitlines()) == 1, r.output
