"""Run folders of frameworks whose own files ckptq must read as they are: litgpt's ``step-N/lit_model.pth``
(tests/fixtures/litgpt, made by the real litgpt: tools/scripts/make_framework_fixtures.py, which also checks that
litgpt's own ``--resume`` stops after ``convert --replace`` and resumes after ``expand``), nanoGPT-style
``checkpoint-N/ckpt.pt`` runs, a Lightning ``checkpoints/`` folder of several ``.ckpt`` files, and ``--all``
over checkpoints some of which hold nothing to convert. Fabric (what litgpt saves with) loads the litgpt files
here with and without ckptq's plugin."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from click.testing import CliRunner

from ckptq.cli import main
from ckptq.codec import signpost
from tests.helpers.models import TinyLM, param_groups, train
from tests.helpers.paths import FIXTURES

LITGPT = os.path.join(FIXTURES, "litgpt")


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def _fabric_load(path: str, plugins: tuple) -> dict:
    """litgpt's resume, ``fabric.load(path, {"optimizer": ...})``, into a torch AdamW over parameters shaped
    like the saved model's (litgpt's own GPT is not installed here); the optimizer's state dict."""
    from lightning.fabric import Fabric

    saved = torch.load(path, weights_only=True)
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in saved["model"].values()]
    fabric = Fabric(accelerator="cpu", devices=1, plugins=list(plugins) or None)
    opt = fabric.setup_optimizers(torch.optim.AdamW(params, lr=1e-3))
    fabric.load(path, {"optimizer": opt}, strict=False)
    return opt.state_dict()


def test_litgpt_run_converts_with_all_and_resumes_through_fabric(tmp_path):
    pytest.importorskip("lightning")
    from ckptq.integrations.lightning import CkptqCheckpointIO

    out = tmp_path / "out"
    shutil.copytree(LITGPT, out)
    newest = out / "step-00000004" / "lit_model.pth"
    want = torch.load(newest, weights_only=True)["optimizer"]
    info = json.loads(run("info", out, "--json").output)
    assert info["type"] == "run" and [p["details"]["framework"] for p in info["parts"]] == ["litgpt", "litgpt"]
    r = run("convert", out, "--all", "--replace")
    assert r.exit_code == 0 and "in place" in r.output, r.output
    assert sorted(os.listdir(out / "step-00000004")) == ["hyperparameters.yaml", "lit_model.pth", "model_config.yaml"]
    assert signpost.carries(torch.load(newest, weights_only=True)["optimizer"])
    r = run("convert", out, "--all")  # after every save: exit 0, each one named as converted
    assert r.exit_code == 0 and "step-00000002 (already converted)" in r.output, r.output
    with pytest.raises(ValueError, match=r"b'ckptq: the optimizer state in lit_model\.pth is stored 8-bit.*"
                                         r"`ckptq expand lit_model\.pth --replace`"):
        _fabric_load(str(newest), ())  # what litgpt --resume does: stops, no fresh optimizer
    got = _fabric_load(str(newest), (CkptqCheckpointIO(),))
    _close(got, want)
    assert run("expand", out / "step-00000004", "--replace").exit_code == 0
    _close(_fabric_load(str(newest), ()), want)  # stock Fabric (litgpt) again


def _close(got: dict, want: dict) -> None:
    for pid, s in want["state"].items():
        assert float(got["state"][pid]["step"]) == float(s["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            scale = float(s[key].abs().max())
            torch.testing.assert_close(got["state"][pid][key], s[key], rtol=0, atol=0.02 * scale + 1e-12)


def _nanogpt_ckpt(path, optimizer_state: dict) -> None:
    model = TinyLM()
    torch.save({"model": model.state_dict(), "optimizer": optimizer_state, "model_args": {"dim": 64}, "iter_num": 3,
                "best_val_loss": torch.tensor(3.0), "config": {}}, path)


def test_nanogpt_style_run_and_a_checkpoint_with_nothing_to_convert(tmp_path):
    """checkpoint-N/ckpt.pt runs convert with --all (they said "nothing to convert" while holding Adam state);
    a checkpoint of Adafactor-like state is skipped and named, and the run exits 0."""
    out = tmp_path / "out"
    for step in (10, 20):
        (out / f"checkpoint-{step}").mkdir(parents=True)
        model = TinyLM()
        opt = torch.optim.AdamW(param_groups(model), lr=1e-2)
        train(model, opt, 2)
        _nanogpt_ckpt(out / f"checkpoint-{step}" / "ckpt.pt", opt.state_dict())
    (out / "checkpoint-30").mkdir()
    factored = {"state": {0: {"step": torch.tensor(3.0), "exp_avg_sq_row": torch.ones(96), "exp_avg_sq_col": torch.ones(64)}},
                "param_groups": [{"lr": 1e-3, "params": [0]}]}
    _nanogpt_ckpt(out / "checkpoint-30" / "ckpt.pt", factored)
    info = json.loads(run("info", out / "checkpoint-10", "--json").output)
    assert info["details"]["framework"] == "nanoGPT" and info["parts"][0]["would_write"] > 0
    r = run("convert", out, "--all")
    assert r.exit_code == 0 and "checkpoint-30 (no Adam moments to store low-bit)" in r.output, r.output
    assert all((out / f"checkpoint-{s}" / "ckpt.q8.safetensors").is_file() for s in (10, 20))
    r = run("convert", out, "--all")
    assert r.exit_code == 0 and r.output.startswith("nothing left to convert") and "(already converted)" in r.output


def test_a_lightning_checkpoints_folder_of_several_ckpt_files_is_a_run(tmp_path):
    from tests.sources.test_folders import lightning_ckpt

    d = tmp_path / "checkpoints"
    d.mkdir()
    for name in ("epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"):
        lightning_ckpt(d / name)
    info = json.loads(run("info", d, "--json").output)
    assert info["type"] == "run" and len(info["parts"]) == 3
    r = run("convert", d)
    assert r.exit_code == 2 and f"ckptq convert {d} --all" in r.output
    r = run("convert", d, "--all", "--keep-last", 1, "--replace")  # last.ckpt, the newest, left for resuming
    assert r.exit_code == 0 and "left as they are: last.ckpt" in r.output, r.output
    assert sorted(os.listdir(d)) == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"]
    saved = [torch.load(d / n, weights_only=True)["optimizer_states"][0] for n in sorted(os.listdir(d))]
    assert [signpost.carries(s) for s in saved] == [True, True, False]


OLMO_CORE = os.path.join(FIXTURES, "olmo_core")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_olmo_core_run_converts_and_its_loader_stops_then_resumes(tmp_path):
    """OLMo-core's run/stepN/model_and_optim/ (tests/fixtures/olmo_core, made by OLMo-core itself: DCP with
    flattened optim.state.<fqn>.exp_avg keys and OLMo-core's own _StorageInfo): info and convert --all of the
    run, a signpost where OLMo-core loads (torch's reader, which OLMo-core's goes through, stops with
    ckptq's message), and expand gives the moments back within 8-bit storage's error. OLMo-core's own load
    after expand: tools/scripts/make_framework_fixtures.py olmo-core-resume."""
    import torch.distributed.checkpoint as dcp

    from ckptq.dcp import SafeFileSystemReader

    run_dir = tmp_path / "run"
    shutil.copytree(OLMO_CORE, run_dir)
    info = json.loads(run("info", run_dir, "--json").output)
    assert info["type"] == "run" and info["parts"][0]["details"]["framework"] == "OLMo-core"
    folder = run_dir / "step3" / "model_and_optim"
    meta = SafeFileSystemReader(str(folder)).read_metadata().state_dict_metadata
    keys = [k for k in meta if k.startswith("optim.state.") and k.endswith(".exp_avg_sq")]
    want = {k: torch.empty(tuple(meta[k].size)) for k in keys}
    dcp.load(want, storage_reader=SafeFileSystemReader(str(folder)), no_dist=True)
    r = run("convert", run_dir, "--all", "--replace")
    assert r.exit_code == 0 and "signpost" in r.output, r.output
    assert signpost.is_signpost_folder(str(folder)) and (run_dir / "step3" / "model_and_optim.q8" / ".metadata").exists()
    with pytest.raises(BaseException, match=r"ckptq: model_and_optim went to model_and_optim\.q8"):
        dcp.load({k: torch.empty_like(v) for k, v in want.items()}, checkpoint_id=str(folder), no_dist=True)
    assert run("convert", run_dir, "--all").output.startswith("nothing left to convert")
    assert run("expand", run_dir / "step3", "--replace").exit_code == 0
    got = {k: torch.empty_like(v) for k, v in want.items()}
    dcp.load(got, checkpoint_id=str(folder), no_dist=True)  # ckptq wrote this .metadata: torch's own classes
    for k in keys:
        torch.testing.assert_close(got[k], want[k], rtol=0.1, atol=1e-3 * float(want[k].abs().max()) + 1e-12)
