"""The command line: happy paths, and every user error is one line, a non-zero exit, no output file."""

import json
import os

import pytest
import torch
from click.testing import CliRunner

from ckptq import cli
from ckptq.cli import main
from tests.helpers.models import tensors


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_convert_info_expand(trained_ckpt, tmp_path):
    path, _, _ = trained_ckpt
    r = run("convert", path, "-q")
    assert r.exit_code == 0 and r.output == ""
    out = tmp_path / "ckpt.q8.safetensors"
    info = json.loads(run("info", out, "--json").output)
    assert info["type"] == "converted" and tensors(info, "exp_avg", 8) >= 2 and tensors(info, "exact", None) > 0
    assert info["ratio"] > 1.3 and info["options"]["block_size"] == 256
    text = run("info", out).output
    assert "exp_avg_sq" in text and "smaller" in text
    pt_info = json.loads(run("info", path, "--json").output)
    assert pt_info["type"] == "torch" and pt_info["details"]["optimizers"] == "optimizer"
    assert tensors(pt_info) == 0 and tensors(pt_info, "exp_avg", None) >= 2 and pt_info["would_write"] < pt_info["bytes"]
    r = run("expand", out, "-o", tmp_path / "e.pt")
    assert r.exit_code == 0 and "wrote" in r.output
    assert torch.load(tmp_path / "e.pt", weights_only=True)["iter_num"] == 20


def test_convert_json_report_and_options(trained_ckpt, tmp_path):
    path, _, _ = trained_ckpt
    r = run("convert", path, "-o", tmp_path / "b.safetensors", "--block-size", 64, "--min-size", 3000, "--json")
    rep = json.loads(r.output)
    assert rep["quantized"] > 0 and rep["kept_small"] > 0 and rep["warnings"] == []
    r = run("convert", path, "-o", tmp_path / "c.safetensors", "--min-size", 100000)  # nothing reaches it
    assert r.exit_code == 3 and "below min_size); lower --min-size (now 100000)" in r.output
    assert not (tmp_path / "c.safetensors").exists()
    r = run("convert", path, "-o", tmp_path / "k.safetensors", "--key", "optimizer", "--json")
    assert json.loads(r.output)["quantized"] >= 4


def _not_a_checkpoint(tmp_path):
    p = tmp_path / "junk.pt"
    p.write_bytes(b"hello, not a checkpoint")
    return p


def _truncated(tmp_path, trained):
    p = tmp_path / "trunc.pt"
    p.write_bytes(open(trained, "rb").read()[:3000])
    return p


def _no_optimizer(tmp_path):
    p = tmp_path / "model_only.pt"
    torch.save({"model": {"w": torch.ones(2)}}, p)
    return p


class Custom:
    pass


def _unsafe(tmp_path):
    p = tmp_path / "unsafe.pt"
    torch.save({"obj": Custom(), "optimizer": {"state": {}, "param_groups": []}}, p)
    return p


@pytest.mark.parametrize("case,args,message", [
    ("missing", lambda t, c: ["convert", t / "nope.pt"], "no such file"),
    ("junk", lambda t, c: ["convert", _not_a_checkpoint(t)], "not a readable torch checkpoint"),
    ("truncated", lambda t, c: ["convert", _truncated(t, c)], "not a readable torch checkpoint"),
    ("no optimizer", lambda t, c: ["convert", _no_optimizer(t)], "no optimizer state dict"),
    ("unsafe", lambda t, c: ["convert", _unsafe(t)], "--trust"),
    ("block size", lambda t, c: ["convert", c, "--block-size", 100], "power of two"),
    ("bad key", lambda t, c: ["convert", c, "--key", "model/nothing"], "no entry"),
    ("shard size", lambda t, c: ["convert", c, "--max-shard-size", "lots"], "300MB"),
    ("expand junk", lambda t, c: ["expand", _not_a_checkpoint(t)], "not a readable torch checkpoint"),
    ("expand pt", lambda t, c: ["expand", c], ""),
    ("info missing", lambda t, c: ["info", t / "nope.safetensors"], "no such file"),
    ("no cuda", lambda t, c: ["convert", c, "--device", "cuda"], "no CUDA device"),
])
def test_user_errors_are_one_line_without_output(case, args, message, trained_ckpt, tmp_path):
    path, _, _ = trained_ckpt
    if case == "no cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    before = set(os.listdir(tmp_path))
    r = run(*args(tmp_path, path))
    assert r.exit_code >= 2, (case, r.output)
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptq: error: ") and message in lines[0], r.output
    assert "Traceback" not in r.output
    created = set(os.listdir(tmp_path)) - before
    assert all(not n.endswith((".safetensors", ".tmp")) and n != "ckpt.fp32.pt" for n in created), created


def test_existing_output_needs_force(trained_ckpt, tmp_path):
    path, _, _ = trained_ckpt
    assert run("convert", path, "-q").exit_code == 0
    out = tmp_path / "ckpt.q8.safetensors"
    stamp = out.stat().st_mtime_ns
    r = run("convert", path, "-q")
    assert r.exit_code == 4 and "--force" in r.output and out.stat().st_mtime_ns == stamp
    assert run("convert", path, "-q", "--force").exit_code == 0


def test_unsafe_checkpoint_converts_with_trust(tmp_path):
    p = tmp_path / "u.pt"
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(5000))])
    opt.param_groups[0]["params"][0].grad = torch.ones(5000)
    opt.step()
    torch.save({"obj": Custom(), "optimizer": opt.state_dict()}, p)
    assert run("convert", p, "-q").exit_code == 3
    # the custom object cannot be stored in a safetensors skeleton either: a clear error, not a crash
    r = run("convert", p, "-q", "--trust")
    assert r.exit_code == 2 and "cannot store Custom at obj" in r.output


def test_help_and_version():
    assert "convert" in run("--help").output and "--max-shard-size" in run("convert", "--help").output
    assert run("--version").output.startswith("ckptq, version")


@pytest.mark.parametrize("failure,code,message", [
    (OSError(28, "No space left on device"), 7, "disk full"),
    (KeyboardInterrupt(), 130, "interrupted"),
])
@pytest.mark.parametrize("compress", [False, True])
def test_write_failure_midway_leaves_nothing_and_input_untouched(failure, code, message, compress, trained_ckpt,
                                                                  tmp_path, monkeypatch):
    """A full disk or Ctrl-C in the middle of writing: one line, no output, no temp file, input as it was."""
    from ckptq.format import safetensors_io

    path, _, _ = trained_ckpt
    before = open(path, "rb").read()
    real_write = safetensors_io._write_tensor
    calls = []

    def failing(f, data):
        calls.append(1)
        if len(calls) == 3:  # after some tensors are already on disk
            raise failure
        return real_write(f, data)

    monkeypatch.setattr(safetensors_io, "_write_tensor", failing)
    r = run("convert", path, *(["--compress"] if compress else []))
    assert r.exit_code == code and message in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]
    assert open(path, "rb").read() == before


def test_expand_interrupted_leaves_nothing(trained_ckpt, tmp_path, monkeypatch):
    from ckptq.codec import quant

    path, _, _ = trained_ckpt
    assert run("convert", path, "-q").exit_code == 0
    src = tmp_path / "ckpt.q8.safetensors"
    before = src.read_bytes()

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(quant, "dequantize_state", interrupted)
    r = run("expand", src)
    assert r.exit_code == 130 and "interrupted" in r.output
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "ckpt.q8.safetensors"] and src.read_bytes() == before


def test_sharded_convert_then_info_and_expand_from_index_or_folder(trained_ckpt, tmp_path):
    path, _, _ = trained_ckpt
    out = tmp_path / "shards"
    out.mkdir()
    r = run("convert", path, "-o", out / "ckpt.q8.safetensors", "--max-shard-size", "40KB", "--compress", "--json")
    outputs = json.loads(r.output)["outputs"]
    assert outputs[0].endswith(".index.json") and len(outputs) > 2
    assert json.loads(run("info", outputs[0], "--json").output)["details"]["files"] == outputs
    for src in (outputs[0], out):
        assert run("expand", src, "-o", tmp_path / "e.pt", "-f", "-q").exit_code == 0
        back = torch.load(tmp_path / "e.pt", weights_only=True)
        assert torch.equal(back["model"]["fc.weight"], torch.load(path, weights_only=True)["model"]["fc.weight"])


def test_malformed_headers_and_expanding_onto_the_input_are_one_line_errors(trained_ckpt, tmp_path):
    import struct

    for i, header in enumerate(([], {"a": {"dtype": "F32", "shape": [1]}}, {"__metadata__": {"ckptq.tensors": "{bad"}})):
        head = json.dumps(header).encode()
        bad = tmp_path / f"bad{i}.safetensors"
        bad.write_bytes(struct.pack("<Q", len(head)) + head)
        for cmd in ("expand", "info"):
            r = run(cmd, bad)
            assert r.exit_code == 5 and r.output.startswith("ckptq: error: ") and "corrupt" in r.output, r.output
    path, _, _ = trained_ckpt
    run("convert", path, "-q")
    conv = tmp_path / "ckpt.q8.safetensors"
    before = conv.read_bytes()
    r = run("expand", conv, "-o", conv, "-f")
    assert r.exit_code == 2 and "is the input" in r.output and conv.read_bytes() == before


def test_converting_a_converted_file_or_a_bad_level_fails_before_any_work(trained_ckpt, tmp_path):
    path, _, _ = trained_ckpt
    run("convert", path, "-q")
    r = run("convert", tmp_path / "ckpt.q8.safetensors", "-o", tmp_path / "again.safetensors")
    assert r.exit_code == 3 and "ckptq expand" in r.output
    r = run("convert", path, "-o", tmp_path / "z.safetensors", "--compress", "--level", 50)
    assert r.exit_code == 2 and "level from 1 to 22" in r.output and not (tmp_path / "z.safetensors").exists()


def test_ctrl_c_before_any_work_is_one_line_and_130(trained_ckpt, monkeypatch):
    """Ctrl-C while the command still imports torch or reads the input (outside the library call): the
    line docs/usage.md promises, not click's "Aborted!" and exit 1."""
    import ckptq

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(ckptq, "info", interrupted)
    monkeypatch.setattr(cli, "_run", lambda fn, *a, **k: fn(*a, **k))  # the interrupt lands outside _run
    r = run("info", trained_ckpt[0])
    assert r.exit_code == 130 and r.output == "ckptq: error: interrupted; no output was written\n", r.output


def test_a_slow_start_shows_its_progress_bar_early(monkeypatch):
    """Reading and planning a large input takes seconds before the first byte is written: the (erased on
    close) bar appears after _FIRST_SIGN_S, not with the first write."""
    import time

    made = []

    class Bar:
        def __init__(self, **kwargs):
            made.append(kwargs)
            self.n, self.total = 0, kwargs["total"]

        def update(self, n):
            self.n += n

        def close(self):
            made.append("closed")

    monkeypatch.setattr("tqdm.tqdm", Bar)
    monkeypatch.setattr(cli, "_FIRST_SIGN_S", 0.01)
    with cli._progress(False, "convert") as update:
        time.sleep(0.3)  # planning
        assert len(made) == 1 and made[0]["total"] is None and made[0]["leave"] is False
        update(5, 10)
    assert made[1:] == ["closed"]


def test_under_torchrun_only_rank_0_prints_the_summary(trained_ckpt, tmp_path, monkeypatch):
    path = trained_ckpt[0]
    monkeypatch.setenv("RANK", "1")
    r = run("convert", path, "-o", tmp_path / "r1.q8.safetensors")
    assert r.exit_code == 0 and r.output == ""
    monkeypatch.setenv("RANK", "0")
    assert "wrote" in run("convert", path, "-o", tmp_path / "r0.q8.safetensors").output
