"""Where outputs may go and what --replace may delete (issue #21, cases 4 and 5): no output path removes
anything ckptq did not write, an output never lies on, around or inside its input, and --replace deletes
only the very file it converted and checked."""

import os

import pytest
import torch
from click.testing import CliRunner

import ckptq
from ckptq.cli import main
from ckptq.codec import signpost
from ckptq.errors import InputError
from ckptq.sources import single
from test_folders import digests, one_line_error, trainer_folder


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def _dcp_folder(path):
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    sd = {"optimizer": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(64, 256, generator=g) * 1e-3,
                                        "exp_avg_sq": torch.rand(64, 256, generator=g) * 1e-6}},
                        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "params": ["w"]}]}}
    dcp.save(sd, checkpoint_id=path, no_dist=True)
    return path


def test_an_output_around_its_input_deletes_nothing_even_with_force(tmp_path):
    """`ckptq convert ckpts/step-1 -o ckpts --force` once deleted all of ckpts/: the source, another
    checkpoint and a notes file."""
    ckpts = tmp_path / "ckpts"
    src = _dcp_folder(ckpts / "step-1")
    other = _dcp_folder(ckpts / "step-2")
    (ckpts / "notes.txt").write_text("keep me")
    before = {p: digests(p) for p in (src, other, ckpts)}
    one_line_error(run("convert", src, "-o", ckpts, "--force"), 2, "holds the input")
    one_line_error(run("convert", src, "-o", src, "--force"), 2, "is the input")
    one_line_error(run("convert", src, "-o", src / "inside", "--force"), 2, "inside the input folder")
    assert {p: digests(p) for p in (src, other, ckpts)} == before


def test_expand_of_a_dcp_folder_never_writes_onto_its_source(tmp_path):
    src = _dcp_folder(tmp_path / "fp32")
    assert run("convert", src, "-o", tmp_path / "q8").exit_code == 0
    before = digests(tmp_path / "q8")
    one_line_error(run("expand", tmp_path / "q8", "-o", tmp_path / "q8", "--force"), 2, "is the input")
    assert digests(tmp_path / "q8") == before


def test_force_replaces_only_what_ckptq_wrote(tmp_path):
    src = _dcp_folder(tmp_path / "src")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "results.csv").write_text("1,2,3")
    one_line_error(run("convert", src, "-o", mine, "--force"), 4, "not a folder ckptq wrote", "nothing was written")
    assert (mine / "results.csv").read_text() == "1,2,3"
    assert run("convert", src, "-o", tmp_path / "out").exit_code == 0
    assert run("convert", src, "-o", tmp_path / "out", "--force").exit_code == 0  # ckptq's own folder: replaced
    model = tmp_path / "model.pt"
    torch.save({"w": torch.ones(3)}, model)  # a torch.save file is not what convert writes
    pt = trainer_folder(tmp_path / "t") / "optimizer.pt"
    one_line_error(run("convert", pt, "-o", model, "--force"), 4, "a torch.save checkpoint", "nothing was written")
    notes = tmp_path / "notes.safetensors"
    notes.write_text("my notes")
    one_line_error(run("convert", pt, "-o", notes, "--force"), 4, "not a checkpoint file")
    assert notes.read_text() == "my notes" and torch.load(model, weights_only=True)["w"].sum() == 3


def test_replace_keeps_a_source_that_was_rewritten_while_it_was_checked(tmp_path, monkeypatch):
    """A trainer rewriting last.ckpt while --replace read the output back once lost its new file."""
    pt = trainer_folder(tmp_path) / "optimizer.pt"
    newer = tmp_path / "newer.pt"
    torch.save({"fresh": torch.arange(5)}, newer)
    check = single.check_converted

    def rewritten_meanwhile(src, outputs, trust=False):
        check(src, outputs, trust)
        os.replace(newer, src)  # atomically, as torch.save to a temp name and a rename does

    monkeypatch.setattr(single, "check_converted", rewritten_meanwhile)
    with pytest.raises(InputError, match="changed while it was converted"):
        ckptq.convert(str(pt), replace=True)
    assert torch.load(pt, weights_only=True)["fresh"].tolist() == list(range(5))  # the new file stays
    assert os.path.exists(str(pt).replace(".pt", ".q8.safetensors"))  # and the output of the old one


def test_replace_deletes_the_source_it_checked(tmp_path):
    pt = trainer_folder(tmp_path) / "optimizer.pt"
    r = ckptq.convert(str(pt), replace=True)
    assert r.removed == [str(pt)] and not pt.exists() and os.path.exists(r.outputs[0])
    leftovers = [n for n in os.listdir(pt.parent) if "ckptq-removing" in n]
    assert leftovers == []


def test_replace_of_a_dcp_folder_checks_the_output_then_removes_the_source(tmp_path):
    src = _dcp_folder(tmp_path / "fp32")
    r = run("convert", src, "-o", tmp_path / "q8", "--replace")
    assert r.exit_code == 0 and "removed" in r.output and signpost.is_signpost_folder(str(src))  # stops dcp.load
    r = run("expand", tmp_path / "q8", "-o", tmp_path / "back", "--replace")
    assert r.exit_code == 0 and not (tmp_path / "q8").exists() and (tmp_path / "back" / ".metadata").exists()
