"""What a new user meets in the first hour: info that tells the truth about every kind of input,
a CLI that answers without importing torch, ckptq.optim after a plain `import ckptq`, one error line under
torchrun, and a whole run's folder converted in one command."""

import json
import os
import subprocess
import sys

import torch
from click.testing import CliRunner

import ckptq
from ckptq.cli import main
from ckptq.codec import signpost
from ckptq.optim import AdamW4bit, AdamW8bit
from tests.sources.test_folders import digests, trainer_folder


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def _info(path, *args) -> dict:
    r = run("info", path, "--json", *args)
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def _stepped(cls, **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 96), torch.nn.Linear(96, 8))
    opt = cls(model.parameters(), lr=1e-3, min_size=1024, **kwargs)
    model(torch.randn(4, 128)).sum().backward()
    opt.step()
    return opt


def test_info_of_an_adamw4bit_state_saved_with_ckptq_save_says_4_bits_and_its_block_size(tmp_path):
    path = str(tmp_path / "a.safetensors")
    ckptq.save({"optimizer": _stepped(AdamW4bit).state_dict()}, path)
    info = _info(path)
    widths = {(r["role"], r["bits"]) for r in info["states"] if r["bits"]}
    assert widths == {("exp_avg", 4), ("exp_avg_sq", 4)} and info["options"]["block_size"] == "128"
    assert all(r["elements"] > 0 and r["stored_bytes"] > 0 for r in info["states"])  # exact rows counted too


def test_info_of_a_torch_save_file_holding_8bit_state_lists_it_as_8bit(tmp_path):
    path = tmp_path / "optimizer.pt"  # what Trainer writes for AdamW8bit
    torch.save(_stepped(AdamW8bit).state_dict(), path)
    info = _info(path)
    # min_size=1024: only the 128x96 weight holds 8-bit state (its exp_avg and exp_avg_sq); the rest is fp32
    assert info["details"]["low_bit_states"] == 2 and sum(r["tensors"] for r in info["states"] if r["bits"] == 8) == 2
    assert info["would_write"] is None and info["warnings"] == []  # nothing left in fp32 to convert: no warning


def test_sizes_are_never_called_smaller_when_they_are_not(tmp_path):
    from ckptq.sources.reports import ratio_words

    assert ratio_words(1000, 999) == "the same size" and ratio_words(1000, 1200) == "1.20x larger"
    assert ratio_words(3000, 1000) == "3.00x smaller"


def test_a_plain_model_safetensors_file_is_described_not_called_damaged(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(4, 4), "b": torch.zeros(4)}, str(path))
    info = _info(path)
    assert info["type"] == "safetensors" and sum(r["tensors"] for r in info["states"]) == 2
    r = run("convert", path)
    assert r.exit_code == 3 and "did not write (model weights?)" in r.output


def test_converting_a_converted_folder_says_so(tmp_path):
    d = trainer_folder(tmp_path)
    assert run("convert", d, "--replace").exit_code == 0
    r = run("convert", d)
    assert r.exit_code == 3 and "converted already (optimizer.q8.safetensors)" in r.output


def test_convert_bits_4_names_a_folders_files_q4(tmp_path):
    d = trainer_folder(tmp_path)
    r = run("convert", d, "--bits", 4, "--min-size", 1000, "--replace")
    assert r.exit_code == 0 and (d / "optimizer.q4.safetensors").exists() and not (d / "optimizer.q8.safetensors").exists()
    assert signpost.is_signpost_file(str(d / "optimizer.pt"))
    assert run("expand", d, "--replace").exit_code == 0 and not signpost.is_signpost_file(str(d / "optimizer.pt"))
    assert not (d / "optimizer.q4.safetensors").exists()


def test_help_and_completion_import_no_torch():
    code = ("import sys; from click.testing import CliRunner; from ckptq.cli import main; "
            "r = CliRunner().invoke(main, ['--help']); assert r.exit_code == 0; "
            "r = CliRunner().invoke(main, ['convert', '--help']); assert 'Store the fp32 Adam moments' in r.output; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    env = {**os.environ, "_CKPTQ_COMPLETE": "bash_complete", "COMP_WORDS": "ckptq con", "COMP_CWORD": "1"}
    code = "import sys, runpy; sys.argv = ['ckptq']\ntry:\n from ckptq.cli import main; main()\nexcept SystemExit: pass\n" \
           "print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert "convert" in r.stdout and r.stdout.strip().endswith("False"), r.stdout


def test_import_ckptq_is_light_and_gives_ckptq_optim():
    code = "import sys, ckptq; light = 'torch' not in sys.modules; print(light, ckptq.optim.AdamW8bit.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "AdamW8bit"]


def test_under_torchrun_an_error_is_one_line_and_no_rank_aborts(tmp_path):
    from tests.sources.test_outputs import _dcp_folder

    src = _dcp_folder(tmp_path / "src")
    (tmp_path / "out").mkdir()  # exists: refused on every rank
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "ckptq",
           "convert", str(src), "-o", str(tmp_path / "out")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in (r.stdout + r.stderr).splitlines() if "ckptq: error:" in line]
    assert r.returncode != 0 and len(lines) == 1 and "exists" in lines[0], r.stderr[-2000:]
    assert "terminate called" not in r.stderr and "SIGABRT" not in r.stderr, r.stderr[-2000:]


def test_a_whole_run_converts_in_one_command_keeping_the_newest(tmp_path):
    out = tmp_path / "out"
    folders = [trainer_folder(out, step) for step in (10, 20, 30)]
    newest = digests(folders[-1])
    r = run("convert", out)
    assert r.exit_code == 2 and "--all" in r.output  # several checkpoints: say how to take them all
    r = run("convert", out, "--all", "--keep-last", 1, "--replace")
    assert r.exit_code == 0 and "left as they are: checkpoint-30" in r.output and "saved" in r.output, r.output
    for d in folders[:2]:
        assert (d / "optimizer.q8.safetensors").exists() and signpost.is_signpost_file(str(d / "optimizer.pt"))
    assert digests(folders[-1]) == newest
    assert _info(out)["type"] == "run"
    converted = [digests(d) for d in folders[:2]]
    r = run("convert", out, "--all", "--keep-last", 1, "--replace")  # a rerun (cron) changes nothing, exit 0
    assert r.exit_code == 0 and r.output.startswith("nothing left to convert") and "checkpoint-10 (already converted)" in r.output
    assert [digests(d) for d in folders[:2]] == converted and digests(folders[-1]) == newest
