"""Where outputs may go and what --replace may delete: no output path removes
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
from tests.sources.test_folders import digests, one_line_error, trainer_folder


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


# --- files ckptq did not write are never removed or overwritten ---------------------------------------------

def test_expand_in_place_leaves_a_users_file_of_the_old_temp_name_alone(tmp_path):
    """`expand checkpoint-4 --replace` with a user's `.optimizer.pt.ckptq-expand.tmp` there deleted it."""
    from ckptq.optim import AdamW8bit
    from tests.helpers.models import TinyLM, param_groups, train

    d = trainer_folder(tmp_path)
    model = TinyLM()
    opt = AdamW8bit(param_groups(model), lr=1e-2, min_size=64)
    train(model, opt, 2)
    torch.save(opt.state_dict(), d / "optimizer.pt")
    mine = d / ".optimizer.pt.ckptq-expand.tmp"
    mine.write_text("my notes")
    assert run("expand", d, "--replace").exit_code == 0
    assert mine.read_text() == "my notes"
    assert "exp_avg" in torch.load(d / "optimizer.pt", weights_only=True)["state"][0]


@pytest.mark.parametrize("content, what", [
    (None, "a zip archive that torch.save did not write"),
    (b'{"notes": "ckptq.format", "x": 1}', "JSON that only mentions ckptq.format"),
    (b"\x80\x02}q\x00.", "a plain pickle"),
])
def test_force_identifies_outputs_by_their_structure(tmp_path, content, what):
    """`--force` overwrote a user's important.zip (any PK\\x03\\x04 counted as torch) and a JSON file with the
    text "ckptq.format" in it."""
    import zipfile

    src = trainer_folder(tmp_path / "t") / "optimizer.pt"
    assert run("convert", src, "-o", tmp_path / "c.q8.safetensors").exit_code == 0
    target = tmp_path / "important.out"
    if content is None:
        with zipfile.ZipFile(target, "w") as z:
            z.writestr("archive/data.txt", "the user's")
    else:
        target.write_bytes(content)
    before = target.read_bytes()
    one_line_error(run("convert", src, "-o", target, "--force"), 4, "nothing was written")
    one_line_error(run("expand", tmp_path / "c.q8.safetensors", "-o", target, "--force"), 4, "nothing was written")
    assert target.read_bytes() == before, what


def test_force_still_replaces_real_outputs(tmp_path):
    src = trainer_folder(tmp_path / "t") / "optimizer.pt"
    q8, pt = tmp_path / "c.q8.safetensors", tmp_path / "c.pt"
    for _ in range(2):
        assert run("convert", src, "-o", q8, "--force").exit_code == 0
        assert run("expand", q8, "-o", pt, "--force").exit_code == 0
    assert run("convert", src, "-o", tmp_path / "s.q8.safetensors", "--max-shard-size", "20KB").exit_code == 0
    assert run("convert", src, "-o", tmp_path / "s.q8.safetensors", "--max-shard-size", "20KB", "--force").exit_code == 0


def test_force_replaces_a_dcp_folder_only_as_ckptq_wrote_it(tmp_path):
    """A converted folder into which the user put a file is not ckptq's alone any more: --force refuses it.
    A user's folder named like the old fixed temp folder is never touched."""
    src = _dcp_folder(tmp_path / "src")
    out = tmp_path / "q8"
    (tmp_path / "q8.ckptq-tmp").mkdir()
    (tmp_path / "q8.ckptq-tmp" / ".ckptq").write_text("{}")
    (tmp_path / "q8.ckptq-tmp" / "mine.txt").write_text("the user's")
    assert run("convert", src, "-o", out).exit_code == 0
    assert run("convert", src, "-o", out, "--force").exit_code == 0  # unchanged: replaced
    (out / "notes.txt").write_text("the user's")
    one_line_error(run("convert", src, "-o", out, "--force"), 4, "not a folder ckptq wrote", "nothing was written")
    assert (out / "notes.txt").read_text() == "the user's"
    assert (tmp_path / "q8.ckptq-tmp" / "mine.txt").read_text() == "the user's"
    assert [n for n in os.listdir(tmp_path) if "ckptq-tmp-" in n] == []


def test_convert_all_replace_never_follows_a_link_out_of_the_run(tmp_path):
    """`convert run --all --replace` followed run/checkpoint-3, a symlink to a folder elsewhere, and deleted
    the optimizer.pt there."""
    run_dir = tmp_path / "run"
    trainer_folder(run_dir, step=1)
    elsewhere = trainer_folder(tmp_path / "elsewhere", step=3)
    (run_dir / "checkpoint-3").symlink_to(elsewhere, target_is_directory=True)
    before = digests(elsewhere)
    r = run("convert", run_dir, "--all", "--replace")
    assert r.exit_code == 0 and "checkpoint-3 (a symlink, not followed)" in r.output, r.output
    assert digests(elsewhere) == before
    assert not (run_dir / "checkpoint-1" / "optimizer.pt").exists() or \
        (run_dir / "checkpoint-1" / "optimizer.q8.safetensors").exists()


# --- a failure message says what is on disk -------------------------------------------------------------

def test_a_failure_after_the_output_was_written_says_so(tmp_path, monkeypatch):
    """A DCP folder holding a dangling symlink under convert --replace exited 7 "no output was written"
    while the output folder was complete."""
    import errno

    from ckptq.sources import original

    src = trainer_folder(tmp_path) / "optimizer.pt"

    def busy(path):
        raise OSError(errno.EBUSY, "Device or resource busy", path)

    monkeypatch.setattr(original.files, "remove_path", busy)
    r = run("convert", src, "--replace")
    one_line_error(r, 3, "optimizer.q8.safetensors written and checked", "could not be deleted", "it was kept")
    assert src.exists() and (src.parent / "optimizer.q8.safetensors").exists()
    monkeypatch.undo()

    def broken(*args, **kwargs):  # the read-back hits an I/O error: the output is there, complete
        raise OSError(errno.EIO, "Input/output error", str(src))

    monkeypatch.setattr(single, "check_converted", broken)
    (src.parent / "optimizer.q8.safetensors").unlink()
    r = run("convert", src, "--replace")
    one_line_error(r, 7, "Input/output error", "optimizer.q8.safetensors written and complete; the original was kept")
    assert src.exists()


def test_a_dangling_symlink_in_a_dcp_folder_does_not_fail_replace(tmp_path):
    src = _dcp_folder(tmp_path / "fp32")
    (src / "dangling").symlink_to(tmp_path / "nowhere")
    r = run("convert", src, "-o", tmp_path / "q8", "--replace")
    assert r.exit_code == 0 and signpost.is_signpost_folder(str(src)) and (tmp_path / "q8" / ".metadata").exists(), \
        r.output
