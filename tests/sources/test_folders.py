"""Checkpoint folders (Trainer ``checkpoint-N/``, accelerate ``save_state``, Lightning ``checkpoints/``):
convert / expand / info DIR, ``--replace``, and the one-line errors. Synthetic folders of each layout here;
the real frameworks' folders and resumes in the tests at the end (skipped where the framework is absent)."""

import hashlib
import json
import os

import pytest
import torch
from click.testing import CliRunner

from ckptq.codec import signpost
from ckptq.sources import readback, single
from ckptq.cli import main
from ckptq.optim import AdamW8bit
from tests.helpers.models import TinyLM, param_groups, train


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def one_line_error(r, code, *words):
    assert r.exit_code == code, r.output
    assert r.output.startswith("ckptq: error: ") and len(r.output.strip().splitlines()) == 1, r.output
    for w in words:
        assert w in r.output, r.output


def trained_optimizer(steps=3, seed=0):
    torch.manual_seed(seed)
    model = TinyLM()
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2)
    train(model, opt, steps)
    return model, opt


def digests(folder):
    return {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in sorted(os.listdir(folder))
            if (folder / n).is_file()}


def trainer_folder(root, step=4):
    """What Hugging Face Trainer writes: optimizer.pt beside the model, scheduler, RNG and trainer state."""
    model, opt = trained_optimizer()
    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    torch.save(opt.state_dict(), d / "optimizer.pt")
    torch.save(torch.optim.lr_scheduler.StepLR(opt, 10).state_dict(), d / "scheduler.pt")
    torch.save({"python": 1, "cpu": torch.get_rng_state()}, d / "rng_state.pth")
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    torch.save(model.state_dict(), d / "model.pt")
    return d


def accelerate_folder(root):
    """What accelerate's save_state writes for two prepared optimizers."""
    d = root / "acc"
    d.mkdir()
    for i, name in enumerate(("optimizer.bin", "optimizer_1.bin")):
        torch.save(trained_optimizer(seed=i)[1].state_dict(), d / name)
    torch.save({}, d / "scheduler.bin")
    torch.save({"step": 3}, d / "random_states_0.pkl")
    torch.save(trained_optimizer()[0].state_dict(), d / "model.safetensors")
    return d


def lightning_ckpt(path):
    model, opt = trained_optimizer()
    torch.save({"epoch": 0, "global_step": 3, "state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()],
                "lr_schedulers": [], "loops": {}, "callbacks": {}, "hyper_parameters": {"dim": 64}}, path)
    return path


def test_trainer_folder_convert_expand_replace_round_trip(tmp_path):
    d = trainer_folder(tmp_path)
    others = {n: h for n, h in digests(d).items() if n != "optimizer.pt"}
    original = torch.load(d / "optimizer.pt", weights_only=True)
    r = run("convert", d, "--replace")
    assert r.exit_code == 0 and "removed" in r.output, r.output
    # a signpost takes optimizer.pt's name: a stock Trainer stops at it instead of starting a fresh optimizer
    assert sorted(os.listdir(d)) == sorted([*others, "optimizer.pt", "optimizer.q8.safetensors"])
    with pytest.raises(ValueError, match=r"could not convert string to float: b'ckptq: the optimizer state of "
                                         r"checkpoint-4 is in optimizer\.q8\.safetensors.*`ckptq expand checkpoint-4`"):
        torch.optim.AdamW(param_groups(TinyLM()), lr=1e-2).load_state_dict(torch.load(d / "optimizer.pt"))
    assert {n: h for n, h in digests(d).items() if n in others} == others  # other files untouched
    info = json.loads(run("info", d, "--json").output)
    assert info["type"] == "folder" and info["details"]["framework"] == "Trainer"
    assert [f["type"] for f in info["parts"]] == ["converted"]
    r = run("expand", d, "--replace")
    assert r.exit_code == 0 and "optimizer.pt" in r.output, r.output
    assert sorted(os.listdir(d)) == sorted([*others, "optimizer.pt"]) and digests(d).items() >= others.items()
    back = torch.load(d / "optimizer.pt", weights_only=True)
    assert back["param_groups"] == original["param_groups"]
    for pid, s in original["state"].items():
        assert torch.equal(back["state"][pid]["step"], s["step"])
        torch.testing.assert_close(back["state"][pid]["exp_avg_sq"], s["exp_avg_sq"], rtol=0.1, atol=1e-9)
    torch.optim.AdamW(param_groups(TinyLM()), lr=1e-2).load_state_dict(back)  # a stock resume's load


def test_without_replace_nothing_is_deleted_and_expand_needs_force(tmp_path):
    d = trainer_folder(tmp_path)
    before = digests(d)
    assert run("convert", d).exit_code == 0
    assert digests(d).items() >= before.items() and "optimizer.q8.safetensors" in os.listdir(d)
    one_line_error(run("expand", d), 4, "optimizer.pt exists", "--force")
    assert digests(d).items() >= before.items()
    r = run("expand", d, "--force")
    assert r.exit_code == 0 and sorted(os.listdir(d)) == sorted([*before, "optimizer.q8.safetensors"]), r.output


def test_accelerate_folder_with_two_optimizers(tmp_path):
    d = accelerate_folder(tmp_path)
    others = {n: h for n, h in digests(d).items() if not n.startswith("optimizer")}
    r = run("convert", d, "--replace", "--json")
    rep = json.loads(r.output)
    assert sorted(map(os.path.basename, rep["outputs"])) == ["optimizer.q8.safetensors", "optimizer_1.q8.safetensors"]
    assert sorted(map(os.path.basename, rep["removed"])) == ["optimizer.bin", "optimizer_1.bin"]
    for name in ("optimizer.bin", "optimizer_1.bin"):  # signposts: accelerate's load_state stops at them
        with pytest.raises(ValueError, match=rf"ckptq: the optimizer state of acc is in {name[:-4]}\.q8\.safetensors"
                                             r".*`ckptq expand acc --replace`"):
            torch.optim.AdamW(param_groups(TinyLM()), lr=1e-2).load_state_dict(torch.load(d / name))
    assert run("expand", d, "--replace").exit_code == 0
    assert sorted(os.listdir(d)) == sorted([*others, "optimizer.bin", "optimizer_1.bin"])
    assert {n: h for n, h in digests(d).items() if n in others} == others


def test_lightning_folder_and_its_optimizer_states_list(tmp_path):
    d = tmp_path / "checkpoints"
    d.mkdir()
    lightning_ckpt(d / "epoch=0-step=3.ckpt")
    info = json.loads(run("info", d, "--json").output)
    assert info["details"]["framework"] == "Lightning" and info["parts"][0]["details"]["optimizers"] == "optimizer_states/0"
    size = os.path.getsize(d / "epoch=0-step=3.ckpt")
    assert run("convert", d, "--replace").exit_code == 0
    # converted in place: the name Lightning resumes from stays, its optimizer states carried by signposts
    assert os.listdir(d) == ["epoch=0-step=3.ckpt"] and os.path.getsize(d / "epoch=0-step=3.ckpt") < 0.7 * size
    saved = torch.load(d / "epoch=0-step=3.ckpt", weights_only=True)
    assert signpost.carries(saved["optimizer_states"][0]) and saved["global_step"] == 3
    assert json.loads(run("info", d, "--json").output)["details"]["framework"] == "Lightning"
    text = run("info", d).output
    assert "(Lightning checkpoint folder)" in text and "optimizer files: 1" in text and "stored by ckptq" in text
    one_line_error(run("convert", d), 3, "already")
    assert run("expand", d, "--replace").exit_code == 0
    assert os.listdir(d) == ["epoch=0-step=3.ckpt"]
    back = torch.load(d / "epoch=0-step=3.ckpt", weights_only=True)
    assert back["global_step"] == 3 and len(back["optimizer_states"]) == 1


def test_several_or_no_candidates_are_one_line_errors_that_say_what_to_pass(tmp_path):
    out = tmp_path / "out"
    for step in (10, 20):
        trainer_folder(out, step)
    one_line_error(run("convert", out), 2, "checkpoint-10, checkpoint-20", f"pass one: ckptq convert {out}/checkpoint-20")
    one_line_error(run("expand", out), 2, "pass one: ckptq expand")
    lt = tmp_path / "lt"
    lt.mkdir()
    lightning_ckpt(lt / "epoch=0-step=3.ckpt")
    lightning_ckpt(lt / "last.ckpt")  # a Lightning checkpoints/ folder of several: a run, as the error says
    one_line_error(run("convert", lt), 2, "2 checkpoint", f"ckptq convert {lt} --all")
    assert run("convert", lt / "last.ckpt", "-q").exit_code == 0  # the file itself
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("x")
    for cmd in ("convert", "info"):
        one_line_error(run(cmd, empty), 3, "optimizer.pt (Trainer)", "found notes.txt", "pass the file")
    ds = tmp_path / "global_step5"
    ds.mkdir()
    (ds / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x")
    for cmd in ("convert", "expand", "info"):
        one_line_error(run(cmd, ds), 3, "DeepSpeed")
    one_line_error(run("convert", trainer_folder(tmp_path / "o"), "-o", tmp_path / "x.safetensors"), 2, "-o does not apply")


def test_expand_of_a_plain_folder_restores_the_recorded_name(trained_ckpt, tmp_path):
    path, _, _ = trained_ckpt  # nanoGPT's out/ckpt.pt
    assert run("convert", path, "--replace", "-q").exit_code == 0
    info = json.loads(run("info", tmp_path, "--json").output)
    assert info["details"]["framework"] == "nanoGPT" and [f["type"] for f in info["parts"]] == ["converted"]
    assert run("expand", tmp_path, "--replace", "-q").exit_code == 0
    assert os.listdir(tmp_path) == ["ckpt.pt"] and torch.load(path, weights_only=True)["iter_num"] == 20


def test_expand_finds_nothing_in_an_fp32_folder(tmp_path):
    d = trainer_folder(tmp_path)
    one_line_error(run("expand", d), 3, "no low-bit optimizer state", "optimizer.pt (Trainer)")


def test_an_8bit_framework_file_is_expanded_in_place_only_with_replace(tmp_path):
    d = trainer_folder(tmp_path)
    model = TinyLM()
    opt = AdamW8bit(param_groups(model), lr=1e-2, min_size=64)
    train(model, opt, 3)
    torch.save(opt.state_dict(), d / "optimizer.pt")  # what Trainer saves after an 8-bit resume
    before = digests(d)
    one_line_error(run("expand", d), 2, "hold 8-bit state", f"ckptq expand {d} --replace")
    assert digests(d) == before
    assert run("expand", d, "--replace").exit_code == 0
    back = torch.load(d / "optimizer.pt", weights_only=True)
    torch_opt = torch.optim.AdamW(param_groups(TinyLM()), lr=1e-2)
    torch_opt.load_state_dict(back)
    assert all(s["exp_avg"].dtype == torch.float32 for s in back["state"].values())
    assert sorted(os.listdir(d)) == sorted(before)  # no temp file left


def test_replace_of_single_files(trained_ckpt, tmp_path):
    path, _, _ = trained_ckpt
    r = run("convert", path, "--replace")
    assert r.exit_code == 0 and not os.path.exists(path), r.output
    r = run("expand", tmp_path / "ckpt.q8.safetensors", "-o", path, "--replace")
    assert r.exit_code == 0 and os.listdir(tmp_path) == ["ckpt.pt"], r.output


def _listing(d):
    return sorted(os.listdir(d))


def test_a_failed_write_during_replace_deletes_nothing_and_leaves_no_file(tmp_path, monkeypatch):
    from ckptq.format import safetensors_io

    d = trainer_folder(tmp_path)
    before = digests(d)

    def fail(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors_io, "write_file", fail)
    r = run("convert", d, "--replace")
    assert r.exit_code == 7 and "disk full" in r.output, r.output
    assert digests(d) == before and _listing(d) == sorted(before)


@pytest.mark.parametrize("damage", ["bytes", "meaning"])
def test_a_bad_readback_during_replace_deletes_nothing(tmp_path, monkeypatch, damage):
    """Damaged bytes (a checksum fails) or a faithful write of the wrong codes (the re-quantization
    differs): the original stays, the bad output goes."""
    d = trainer_folder(tmp_path)
    before = digests(d)
    if damage == "bytes":
        real = single.check_converted

        def flip_then_check(src, outputs, trust=False):
            with open(outputs[-1], "r+b") as f:
                f.seek(-3, os.SEEK_END)
                byte = f.read(1)
                f.seek(-3, os.SEEK_END)
                f.write(bytes([byte[0] ^ 0x10]))
            return real(src, outputs, trust)

        monkeypatch.setattr(single, "check_converted", flip_then_check)
    else:
        real_requantize = readback._requantize

        def off_by_one(*a):
            q = real_requantize(*a)
            q["codes"] = q["codes"].clone()
            q["codes"][0] ^= 1
            return q

        monkeypatch.setattr(readback, "_requantize", off_by_one)
    r = run("convert", d, "--replace")
    assert r.exit_code == 5 and len(r.output.strip().splitlines()) == 1, r.output
    assert digests(d) == before and _listing(d) == sorted(before)


def test_a_bad_readback_during_expand_replace_keeps_the_converted_file(tmp_path, monkeypatch):
    d = trainer_folder(tmp_path)
    assert run("convert", d, "--replace").exit_code == 0
    before = digests(d)

    def wrong(want):
        if isinstance(want, torch.Tensor) and want.dtype == torch.float32 and want.numel() > 1000:
            return want + 1
        return want

    monkeypatch.setattr(readback, "_materialize", wrong)
    r = run("expand", d, "--replace")
    assert r.exit_code == 5 and "does not read back" in r.output and len(r.output.strip().splitlines()) == 1
    assert digests(d) == before  # optimizer.q8.safetensors and the signpost kept, the bad optimizer.pt removed


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_accelerate_fsdp_dcp_subfolder_goes_to_the_dcp_code(tmp_path):
    import torch.distributed.checkpoint as dcp

    d = tmp_path / "acc"
    d.mkdir()
    torch.save({"step": 1}, d / "random_states_0.pkl")
    g = torch.Generator().manual_seed(0)
    m, v = torch.randn(64, 256, generator=g) * 1e-3, torch.rand(64, 256, generator=g) * 1e-6
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "params": ["w"]}]
    sd = {"optimizer": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": m, "exp_avg_sq": v}},
                        "param_groups": groups}}
    dcp.save(sd, checkpoint_id=d / "optimizer_0", no_dist=True)
    r = run("convert", d, "--replace")  # read back and checked, then the fp32 folder goes
    assert r.exit_code == 0 and "removed" in r.output and (d / "optimizer_0.q8" / ".metadata").exists()
    assert signpost.is_signpost_folder(str(d / "optimizer_0"))  # where accelerate's load_state looks
    back = {"optimizer": {"state": {"w": {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(m),
                                          "exp_avg_sq": torch.zeros_like(v)}}, "param_groups": groups}}
    with pytest.raises(BaseException, match=r"invalid literal for int\(\) with base 10: 'ckptq: optimizer_0 went to "
                                            r"optimizer_0\.q8 \(8-bit Adam state\); for fp32: ckptq expand"):
        dcp.load(back, checkpoint_id=d / "optimizer_0", no_dist=True)  # accelerate's FSDP load, stopped
    one_line_error(run("info", d / "optimizer_0"), 3, "is a signpost")
    assert run("expand", d).exit_code == 0  # over the signpost, no --force
    dcp.load(back, checkpoint_id=d / "optimizer_0", no_dist=True)
    torch.testing.assert_close(back["optimizer"]["state"]["w"]["exp_avg_sq"], v, rtol=0.1, atol=1e-12)
