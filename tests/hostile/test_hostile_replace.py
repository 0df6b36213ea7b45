"""What ckptq removes and replaces: a folder is ckptq's signpost only while it holds
exactly what ckptq wrote there, and nothing else is ever removed; the in-place ``--replace`` keeps the name
at every instant, refuses a damaged or symlinked original, and a killed run's leftovers go with the next run.
The seeded campaigns of tests/helpers/hostile_replace.py run in a child (the kill campaign forks)."""

import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch
from click.testing import CliRunner

import ckptq
from ckptq.cli import main
from ckptq.codec import signpost
from ckptq.format import journal, torch_zip
from tests.helpers.hostile_replace import LAYOUTS, REPLACE_KINDS, _trainer, accelerate, lightning, litgpt, tree
from tests.helpers.paths import child_env
pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
              pytest.mark.filterwarnings("ignore:Detected an existing checkpoint")]


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def refused(r, *words):
    assert r.exit_code not in (0, 70) and len(r.output.strip().splitlines()) == 1, r.output
    assert r.output.startswith("ckptq: error: ") and all(w in r.output for w in words), r.output


@pytest.fixture
def dcp_pair(tmp_path):
    """(an fp32 DCP folder, its conversion X.q8)."""
    accelerate(str(tmp_path / "acc"))
    os.rename(tmp_path / "acc" / "optimizer_0", tmp_path / "fp32")
    ckptq.convert(str(tmp_path / "fp32"), str(tmp_path / "X.q8"))
    return tmp_path / "fp32", tmp_path / "X.q8"


# --- item 1: signposts ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args", [["expand", "X.q8", "-o", "v"], ["expand", "X.q8", "-o", "v", "--force"],
                                  ["convert", "fp32", "-o", "v"], ["convert", "fp32", "-o", "v", "--force"]])
def test_a_signpost_marker_never_makes_ckptq_remove_a_folder(dcp_pair, tmp_path, args):
    """``echo '{"kind":"signpost","message":""}' > v/.ckptq``: expand exited 0, thesis.txt was gone."""
    v = tmp_path / "v"
    v.mkdir()
    (v / "thesis.txt").write_text("precious")
    (v / ".ckptq").write_text('{"kind":"signpost","message":""}')
    before = tree(str(tmp_path))
    refused(cli(*[tmp_path / a if a in ("X.q8", "fp32", "v") else a for a in args]), "also holds thesis.txt", "kept")
    assert tree(str(tmp_path)) == before


def test_a_framework_folders_expand_keeps_a_folder_a_marker_calls_a_signpost(dcp_pair, tmp_path):
    d = tmp_path / "acc"
    os.rename(dcp_pair[1], d / "optimizer_0.q8")
    (d / "optimizer_0").mkdir()
    (d / "optimizer_0" / "thesis.txt").write_text("precious")
    (d / "optimizer_0" / ".ckptq").write_text('{"kind":"signpost","message":""}')
    before = tree(str(d))
    for extra in ([], ["--replace"]):
        refused(cli("expand", d, *extra), "optimizer_0 holds a ckptq signpost marker")
        assert tree(str(d)) == before


def test_a_signpost_that_dcp_save_wrote_into_is_training_state_again(tmp_path):
    """After ``convert CKPT --replace`` of an accelerate folder, ``dcp.save`` into ``optimizer_0/`` keeps the
    ``.ckptq`` file: info called the folder a signpost and ``expand CKPT`` replaced the new training state."""
    import torch.distributed.checkpoint as dcp

    d = tmp_path / "acc"
    accelerate(str(d))
    assert cli("convert", d, "--replace").exit_code == 0 and signpost.is_signpost_folder(str(d / "optimizer_0"))
    fresh = {"optimizer": {"state": {"w0": {"step": torch.tensor(9.0), "exp_avg": torch.randn(64, 128),
                                            "exp_avg_sq": torch.rand(64, 128)}},
                           "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "params": ["w0"]}]}}
    dcp.save(fresh, checkpoint_id=d / "optimizer_0", no_dist=True)  # accelerate saving again
    assert (d / "optimizer_0" / ".ckptq").exists() and not signpost.is_signpost_folder(str(d / "optimizer_0"))
    r = cli("info", d / "optimizer_0")
    assert r.exit_code == 0 and "signpost (no" not in r.output and "a program wrote into it since" in r.output, r.output
    before = tree(str(d))
    for extra in ([], ["--replace"], ["--replace", "--force"]):
        refused(cli("expand", d, *extra), "also holds __0_0.distcp", "it was kept")
        assert tree(str(d)) == before


def test_old_signposts_without_a_file_list_are_recognised_only_when_exact(dcp_pair, tmp_path):
    """A signpost written before markers listed files: still one if it holds exactly ckptq's ``.metadata``
    for its message (which decides every byte), refused otherwise."""
    fp32, q8 = dcp_pair
    message = signpost.dcp_message("v", "X.q8")
    for tampered in (False, True):
        v = tmp_path / "v"
        signpost.write_folder(str(v), message)
        (v / ".ckptq").write_text(json.dumps({"created_by": "ckptq", "kind": "signpost", "message": message}))
        if tampered:
            with open(v / ".metadata", "ab") as f:
                f.write(b"\x00")
        assert signpost.is_signpost_folder(str(v)) is not tampered
        r = cli("expand", q8, "-o", v)
        if tampered:
            refused(r, "is not the one ckptq wrote")
        else:
            assert r.exit_code == 0 and (v / "__0_0.distcp").exists(), r.output
        shutil.rmtree(v)


def test_ckptqs_own_signpost_is_still_replaced_without_force(dcp_pair, tmp_path):
    fp32, q8 = dcp_pair
    signpost.write_folder(str(tmp_path / "v"), signpost.dcp_message("v", "X.q8"))
    assert cli("expand", q8, "-o", tmp_path / "v").exit_code == 0
    assert not signpost.is_signpost_folder(str(tmp_path / "v")) and (tmp_path / "v" / ".metadata").exists()
    assert [n for n in os.listdir(tmp_path) if journal.TMP_MARK in n or journal.ASIDE_MARK in n] == []


# --- item 3: in-place --replace ------------------------------------------------------------------------------

def _flip_data_byte(path):
    with zipfile.ZipFile(path) as z:
        rec = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size > 16)
    raw = bytearray(open(path, "rb").read())
    with open(path, "rb") as f:
        raw[torch_zip._data_offset(f, rec) + 5] ^= 0x40
    open(path, "wb").write(bytes(raw))


@pytest.mark.parametrize("verb", ["convert", "expand"])
def test_a_damaged_ckpt_is_refused_not_replaced(tmp_path, verb):
    """A bit flipped in a data record: ``convert dmg.ckpt --replace`` exited 0 ("read back and checked") and
    the damaged original was gone; torch.load reads it without a word, so its CRC-32s are checked first."""
    path = lightning(str(tmp_path / "run"))[0]
    if verb == "expand":
        ckptq.convert(path, replace=True)
    _flip_data_byte(path)
    torch.load(path, weights_only=True)  # no torch.load checks the CRCs
    before = tree(str(tmp_path))
    refused(cli(verb, path, "--replace"), "does not match its checksum")
    assert tree(str(tmp_path)) == before


@pytest.mark.parametrize("where", ["trainer", "lightning", "litgpt"])
def test_a_symlinked_original_is_refused_by_name_and_nothing_is_left(tmp_path, where):
    """A Trainer folder whose optimizer.pt is a symlink: convert --replace said the file "changed while it was
    converted" and left a ``.optimizer.pt.ckptq-tmp-*``."""
    make = {"trainer": _trainer, "lightning": lightning, "litgpt": litgpt}[where]
    folder, name = make(str(tmp_path / "ckpt"))
    moved = tmp_path / "elsewhere.bin"
    os.rename(name, moved)
    os.symlink(moved, name)
    before = tree(str(tmp_path))
    for arg in {folder, name}:
        refused(cli("convert", arg, "--replace"), f"{name} is a symbolic link")
        assert tree(str(tmp_path)) == before


def test_an_in_place_expands_temp_that_a_second_temp_replaced_is_still_journaled(tmp_path, monkeypatch):
    """The in-place expand writes its file through a second temp renamed over the first: its journal named the
    first (another inode), so after a kill the full-size temp survived every later run."""
    from ckptq.format import atomic

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = lightning(str(tmp_path / "run"))[0]
    ckptq.convert(path, replace=True)
    seen = []
    real = atomic.swap_in

    def stop(new, dst, check):  # the moment a kill would come: before the expanded file takes the name
        seen.extend(e for e in journal.JOURNAL.entries if e["path"] == os.path.abspath(new) and journal.ours(e))
        raise KeyboardInterrupt

    monkeypatch.setattr(atomic, "swap_in", stop)
    with pytest.raises(KeyboardInterrupt):
        ckptq.expand(path, replace=True)
    monkeypatch.setattr(atomic, "swap_in", real)
    assert seen, "the temp that takes the name is not journaled as the file it is"


# --- the campaigns ---------------------------------------------------------------------------------------------

def _campaign(tmp_path, trials, **kw):
    code = (f"import json, os; os.environ['OMP_NUM_THREADS'] = '1'; "
            f"import tests.helpers.hostile_replace as h; os.chdir({str(tmp_path)!r}); "
            f"print(json.dumps(h.replace_campaign({trials!r}, 34, {str(tmp_path)!r}, **{kw!r})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                       env=child_env(OMP_NUM_THREADS="1"))  # the child imports tests.helpers
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.splitlines()[-1])
    assert res.pop("examples") == [], res
    return res


def test_signpost_and_damage_campaigns_refuse_what_ckptq_did_not_write(tmp_path):
    """40 folders a marker calls a signpost (crafted, written into by dcp.save, or ckptq's own, new and old)
    as the output of expand / convert -o (with and without --force) and of a framework folder's expand; 24
    damaged or symlinked originals of --replace. Crafted and written-into folders refused, ckptq's own
    replaced; every damaged or linked original refused with the folder as it was."""
    res = _campaign(tmp_path, {"signpost": 40, "damage": 24}, kill_points=0)
    assert set(res) == set(REPLACE_KINDS)
    assert set(res["signpost"]) == {"refused", "handled"} and sum(res["signpost"].values()) == 40, res
    assert res["damage"] == {"refused": 24}, res


# where the kills also come right after each operation: one layout per code path (a file converted in place;
# a DCP folder swapped with its signpost); `python -m tests.helpers.hostile_replace` kills after each one everywhere
_AFTER_TOO = ("lightning", "accelerate")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_kill_at_every_rename_and_unlink_of_replace_leaves_a_complete_checkpoint(tmp_path, layout):
    """convert --replace then expand --replace, SIGKILLed right before (and for one layout per code path,
    right after) each rename, link, unlink, folder removal and swap on the checkpoint's folder: the name holds
    the old checkpoint or the new one, complete, every time, and the next run cleans up and finishes."""
    whens = ("before", "after") if layout in _AFTER_TOO else ("before",)
    res = _campaign(tmp_path, {}, layouts=(layout,), whens=whens)["kill"]
    assert set(res) == {f"{layout} convert", f"{layout} expand"}, res
    for scenario, counts in res.items():
        ops = counts.pop("operations")
        assert ops >= 3 and sum(counts.values()) == ops * len(whens), (scenario, counts)
        assert set(counts) <= {"handled (old)", "handled (new)"} and len(counts) == 2, (scenario, counts)


@pytest.mark.parametrize("folder", [False, True])
def test_swap_in_keeps_what_its_check_refuses_and_never_journals_it_for_removal(tmp_path, folder, monkeypatch):
    """What is at the name is not the file that was converted (a trainer rewrote it): kept where it was, the
    replacement left to its caller, and nothing of it in the journal that a later run would delete."""
    from ckptq.format import atomic

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    work = tmp_path / "w"
    work.mkdir()
    dst, new = work / "name", work / ".name.ckptq-tmp-x"
    for p, text in ((dst, "the trainer's"), (new, "ckptq's")):
        if folder:
            p.mkdir()
            (p / "f").write_text(text)
        else:
            p.write_text(text)

    def changed(path):
        raise atomic.InputError("changed")

    def journaled():
        return [e for e in journal.JOURNAL.entries if e["path"].startswith(str(work))]

    with pytest.raises(atomic.InputError):
        atomic.swap_in(str(new), str(dst), changed)
    read = (lambda p: (p / "f").read_text()) if folder else (lambda p: p.read_text())
    assert read(dst) == "the trainer's" and read(new) == "ckptq's"
    assert sorted(os.listdir(work)) == [".name.ckptq-tmp-x", "name"] and journaled() == []
    atomic.swap_in(str(new), str(dst), lambda path: None)
    assert read(dst) == "ckptq's" and os.listdir(work) == ["name"] and journaled() == []
