"""DeepSpeed ZeRO checkpoints: info, convert and expand of real DeepSpeed files (tests/fixtures/zero/, made
by tools/scripts/make_zero_fixtures.py: a 1,928-parameter MLP, 3 AdamW steps, 2 ranks, ZeRO stage 1, 2, 3 and
stage 2 with bf16), without DeepSpeed installed. The end-to-end test at the bottom trains, converts,
expands and resumes with real DeepSpeed (skipped unless deepspeed is importable)."""

import hashlib
import json
import os
import shutil
import time

import pytest
import torch
from click.testing import CliRunner

import ckptq
from ckptq.deepspeed import objects as zero_pickle
from ckptq.cli import main
from ckptq.errors import InputError, OutputExistsError, UsageError
from ckptq import info
from tests.helpers import paths
from tests.helpers.tools import load_tool

FIXTURES = os.path.join(paths.FIXTURES, "zero")
CASES = {"zero1": (1, False), "zero2": (2, False), "zero3": (3, False), "zero2_bf16": (2, True)}
MIN = 256  # the fixtures' flat partitions hold 964 elements per rank
MOMENTS = ("exp_avg", "exp_avg_sq")


def copy(name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(os.path.join(FIXTURES, name), dst)
    return dst


def rank_files(save_dir, suffix=".pt"):
    step = save_dir / "global_step3"
    return sorted(step / n for n in os.listdir(step) if n.endswith("_optim_states" + suffix))


def digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def inner_state(obj):
    """The torch optimizer state dict inside a ZeRO rank file (stage 1/2 and stage 3 name it differently)."""
    osd = obj["optimizer_state_dict"]
    return osd.get("base_optimizer_state") or osd["optimizer_state_dict"]


def compare(original, restored, path=""):
    """Every tensor bit-equal except the Adam moments (returned as (path, original, restored) pairs), and
    DeepSpeed's objects the same global, arguments and state."""
    assert type(original) is type(restored), path
    if isinstance(original, torch.Tensor):
        if path.rsplit("/", 1)[-1] in MOMENTS:
            assert original.dtype == restored.dtype and original.shape == restored.shape, path
            return [(path, original, restored)]
        assert original.dtype == restored.dtype and torch.equal(original, restored), path
        return []
    if isinstance(original, zero_pickle._Standin):
        assert original._ckptq_global == restored._ckptq_global and original._args == restored._args, path
        assert original._called == restored._called and original._state == restored._state, path
        return []
    if isinstance(original, dict):
        assert list(original) == list(restored), path
        return [m for k in original for m in compare(original[k], restored[k], f"{path}/{k}")]
    if isinstance(original, (list, tuple)):
        assert len(original) == len(restored), path
        return [m for i, (a, b) in enumerate(zip(original, restored)) for m in compare(a, b, f"{path}/{i}")]
    assert original == restored, path
    return []


def update_error(state, restored_state, eps=1e-8):
    """Relative L2 error of Adam's update direction m / (sqrt(v) + eps) computed from restored moments."""
    u = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + eps)
    uq = restored_state["exp_avg"] / (restored_state["exp_avg_sq"].sqrt() + eps)
    return float((uq - u).norm() / u.norm())


@pytest.mark.parametrize("name", list(CASES))
def test_info_describes_the_checkpoint_and_predicts_convert_to_the_byte(name, tmp_path):
    stage, bf16 = CASES[name]
    save = copy(name, tmp_path)
    r = info(str(save), min_size=MIN)
    d = r.details
    assert (r.type, d["stage"], d["world_size"], d["bf16"], d["params"]) == ("deepspeed", stage, 2, bf16, 1928)
    assert d["rank_files"] == 2
    loaded = [zero_pickle.load(str(p)) for p in rank_files(save)]
    moments = sum(t.numel() * t.element_size() for o in loaded for st in inner_state(o)["state"].values()
                  for k, t in st.items() if k in MOMENTS)
    assert sum(row.stored_bytes for row in r.states if row.bits is None and row.role in MOMENTS) == moments > 0
    report = ckptq.convert(str(save), min_size=MIN)
    assert report.output_bytes == r.would_write
    assert report.quantized == 4 == sum(row.tensors for row in r.would_store)  # two moments on each of two ranks
    after = info(str(save / "global_step3"), min_size=MIN)
    assert after.details["converted_bytes"] == report.output_bytes and after.low_bit() == 4


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_convert_then_expand_restores_every_byte_but_the_moments(name, bits, tmp_path):
    """At 8 bits and at 4 (every stage, bf16 too): the .pt files come back from the low-bit files alone,
    the update direction within the width's error (measured worst on these files: 8 bits 0.44%, 4 bits 1.49%)."""
    save = copy(name, tmp_path)
    originals = {p.name: zero_pickle.load(str(p)) for p in rank_files(save)}
    hashes = {p: digest(p) for p in rank_files(save)}
    model = [save / "global_step3" / n for n in os.listdir(save / "global_step3") if "model_states" in n]
    model_hashes = {p: digest(p) for p in model}
    report = ckptq.convert(str(save), min_size=MIN, bits=bits)
    assert sorted(report.outputs) == sorted(str(p)[: -len(".pt")] + f".q{bits}.safetensors" for p in hashes)
    assert {p: digest(p) for p in hashes} == hashes  # the input is untouched
    for p in hashes:
        os.unlink(p)  # what DeepSpeed needs back comes from the 8-bit files alone
    r = ckptq.expand(str(save))
    assert r.output == str(save / "global_step3")
    for p in hashes:
        restored = zero_pickle.load(str(p))
        moments = compare(originals[p.name], restored)
        assert len(moments) == 2
        assert any(not torch.equal(a, b) for _, a, b in moments)  # stored 8-bit, so not bit-exact ...
        error = update_error(inner_state(originals[p.name])["state"][0], inner_state(restored)["state"][0])
        assert error < (0.02 if bits == 8 else 0.03)
        globals_of = torch.serialization.get_unsafe_globals_in_checkpoint  # DeepSpeed's classes, by name
        assert sorted(globals_of(str(p))) == sorted(globals_of(os.path.join(FIXTURES, name, "global_step3", p.name)))
    assert {p: digest(p) for p in model} == model_hashes


def test_a_single_rank_file_converts_alone_and_expands_back(tmp_path):
    save = copy("zero3", tmp_path)
    rank0, rank1 = rank_files(save)
    report = ckptq.convert(str(rank1), min_size=MIN)
    assert report.outputs == [str(rank1)[: -len(".pt")] + ".q8.safetensors"]
    assert not os.path.exists(str(rank0)[: -len(".pt")] + ".q8.safetensors")
    with pytest.raises(OutputExistsError):
        ckptq.expand(report.outputs[0])  # the .pt is still there
    os.unlink(rank1)
    os.rename(rank0, tmp_path / rank0.name)
    with pytest.raises(InputError, match=r"the optimizer file of rank 0 \(mp rank 00\) is missing"):
        ckptq.expand(str(save))
    os.rename(tmp_path / rank0.name, rank0)
    ckptq.expand(str(save))  # rank 0 in fp32, rank 1 8-bit: the folder is whole
    assert len(compare(zero_pickle.load(os.path.join(FIXTURES, "zero3", "global_step3", rank1.name)),
                       zero_pickle.load(str(rank1)))) == 2


def rewrite(path, obj):
    """Save ``obj`` (loaded memory-mapped from ``path``) over ``path``: beside it first, then renamed. The
    pickler writes any global, as a crafted file would (ckptq's own writes only those DeepSpeed writes)."""
    from ckptq.format import torch_stream
    from tests.helpers.hostile import CraftingPickler

    torch_stream.save(obj, f"{path}.new", pickler=CraftingPickler)
    os.replace(f"{path}.new", path)


def _missing_rank(save):
    os.unlink(rank_files(save)[1])


def _extra_rank(save):
    shutil.copy(rank_files(save)[1], save / "global_step3" / "zero_pp_rank_2_mp_rank_00_optim_states.pt")


def _damaged_rank(save):
    p = rank_files(save)[1]
    p.write_bytes(p.read_bytes()[:2000])


def _bad_latest(save):
    (save / "latest").write_text("global_step9")


class UserConfig:
    """A class of the user's in a ZeRO file (client state): ckptq never unpickles it."""


def _foreign_object(save):
    obj = zero_pickle.load(str(rank_files(save)[0]))
    obj["user"] = UserConfig()
    rewrite(rank_files(save)[0], obj)


@pytest.mark.parametrize("damage, message", [
    (_missing_rank, "the optimizer file of rank 1 (mp rank 00) is missing"),
    (_extra_rank, "3 rank files per model-parallel rank, but they were written by 2 ranks"),
    (_damaged_rank, "is not a readable torch checkpoint"),
    (_bad_latest, "names tag 'global_step9', but"),
    (_foreign_object, f"needs arbitrary unpickling of {__name__}.UserConfig"),  # this module, as pickle names it
])
def test_bad_checkpoints_are_one_line_errors_and_nothing_is_written(damage, message, tmp_path):
    save = copy("zero2", tmp_path)
    damage(save)
    before = {n: os.path.getsize(save / "global_step3" / n) for n in os.listdir(save / "global_step3")}
    res = CliRunner().invoke(main, ["convert", str(save), "--min-size", str(MIN)], catch_exceptions=False)
    assert res.exit_code == 3 and message in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert {n: os.path.getsize(save / "global_step3" / n) for n in os.listdir(save / "global_step3")} == before


def test_mixed_world_sizes_and_foreign_files_are_refused(tmp_path):
    save = copy("zero2", tmp_path)
    rank1 = rank_files(save)[1]
    obj = zero_pickle.load(str(rank1))
    obj["optimizer_state_dict"]["partition_count"] = [4]
    rewrite(rank1, obj)
    with pytest.raises(InputError, match="written at different world sizes"):
        ckptq.convert(str(save), min_size=MIN)
    with pytest.raises(InputError, match="written at different world sizes"):
        info(str(save), min_size=MIN)
    plain = tmp_path / "plain" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    plain.parent.mkdir()
    torch.save({"state": {}, "param_groups": []}, plain)
    with pytest.raises(InputError, match="is not a DeepSpeed ZeRO optimizer file"):
        ckptq.convert(str(plain.parent))
    not_zero = tmp_path / "other"
    not_zero.mkdir()
    (not_zero / "notes.txt").write_text("x")
    with pytest.raises(InputError, match="not a torch.distributed.checkpoint folder"):
        ckptq.convert(str(not_zero))


def test_outputs_need_force_and_stay_beside_the_partitions(tmp_path):
    save = copy("zero1", tmp_path)
    ckptq.convert(str(save), min_size=MIN)
    with pytest.raises(OutputExistsError):
        ckptq.convert(str(save), min_size=MIN)
    with pytest.raises(UsageError, match="converted beside its partition files"):
        ckptq.convert(str(save), str(tmp_path / "elsewhere"), min_size=MIN)
    with pytest.raises(OutputExistsError):
        ckptq.expand(str(save))  # the fp32 files are still there
    with pytest.raises(UsageError, match="expanded beside its partition files"):
        ckptq.expand(str(save), str(tmp_path / "elsewhere"))
    with pytest.raises(InputError, match="no Adam moment to store low-bit"):
        ckptq.convert(str(save), force=True)  # 964 elements per rank: below the default min size
    assert ckptq.convert(str(save), min_size=MIN, force=True).quantized == 4
    plain = tmp_path / "plain.q8.safetensors"
    ckptq.save({"x": torch.zeros(3)}, str(plain))
    renamed = save / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.q8.safetensors"
    shutil.copy(plain, renamed)
    with pytest.raises(InputError, match="was not converted from a DeepSpeed ZeRO optimizer file"):
        ckptq.expand(str(save), force=True)


def test_cli_info_convert_expand(tmp_path):
    save = copy("zero3", tmp_path)
    run = CliRunner().invoke
    res = run(main, ["info", str(save), "--min-size", str(MIN)], catch_exceptions=False)
    assert res.exit_code == 0 and "DeepSpeed ZeRO stage 3 checkpoint" in res.output and "params: 1928" in res.output
    res = run(main, ["convert", str(save), "--min-size", str(MIN), "--json"], catch_exceptions=False)
    assert res.exit_code == 0 and json.loads(res.output)["quantized"] == 4
    for p in rank_files(save):
        os.unlink(p)
    res = run(main, ["info", str(save), "--json"], catch_exceptions=False)
    r = json.loads(res.output)
    assert r["details"]["converted_bytes"] == r["bytes"] > 0 and r["would_write"] is None
    assert sum(row["tensors"] for row in r["states"] if row["bits"] == 8) == 4
    res = run(main, ["expand", str(save)], catch_exceptions=False)
    assert res.exit_code == 0 and len(rank_files(save)) == 2


def test_universal_folder_converts_per_parameter_and_expands_back(tmp_path):
    save = copy("zero2", tmp_path)
    uni = save / "global_step3_universal"
    moment_files = sorted(uni.glob("zero/*/exp_avg*.pt"))
    originals = {p: torch.load(p, weights_only=True) for p in moment_files}
    untouched = {p: digest(p) for p in sorted(uni.glob("zero/*/fp32.pt")) + sorted(uni.glob("zero/*/step.pt"))}
    before = info(str(uni), min_size=16)
    assert (before.kind, before.details["parameters"], before.details["params"]) == \
        ("DeepSpeed universal checkpoint", 8, 1928)
    assert sum(row.stored_bytes for row in before.states if row.role in MOMENTS) == \
        sum(t["param"].numel() * 4 for t in originals.values())
    report = ckptq.convert(str(uni), min_size=16)
    assert report.output_bytes == before.would_write and len(report.outputs) == 8
    assert report.quantized == 14 and report.kept_small == 2  # 5.bias has 8 elements
    for p in moment_files:
        os.unlink(p)
    res = CliRunner().invoke(main, ["info", str(uni)], catch_exceptions=False)
    assert res.exit_code == 0 and "(DeepSpeed universal checkpoint)" in res.output and "parameters: 8" in res.output
    ckptq.expand(str(uni))
    for p, o in originals.items():
        r = torch.load(p, weights_only=True)
        assert list(r) == list(o) and r["cat_dim"] == o["cat_dim"] and r["param"].shape == o["param"].shape
        err = float((r["param"] - o["param"]).abs().max() / o["param"].abs().max())
        assert err < 0.02 and (err > 0) == (o["param"].numel() >= 16), (p, err)
    state = {n: torch.load(uni / "zero" / "2.weight" / f"{n}.pt", weights_only=True)["param"] for n in MOMENTS}
    assert update_error({n: originals[uni / "zero" / "2.weight" / f"{n}.pt"]["param"] for n in MOMENTS}, state) < 0.02
    assert {p: digest(p) for p in untouched} == untouched
    os.unlink(uni / "zero" / "2.weight" / "exp_avg_sq.pt")  # a parameter whose second moment is lost
    converted = {p: digest(p) for p in uni.glob("zero/*/moments.q8.safetensors")}
    res = CliRunner().invoke(main, ["convert", str(uni), "--force"], catch_exceptions=False)
    assert res.exit_code == 3 and "holds exp_avg.pt but not exp_avg_sq.pt" in res.output
    assert {p: digest(p) for p in uni.glob("zero/*/moments.q8.safetensors")} == converted


# ---- end to end with real DeepSpeed (CPU, 2 processes over gloo) ----

def test_deepspeed_resumes_from_expanded_files_with_the_losses_of_an_uninterrupted_run(tmp_path):
    """ZeRO 1, 2, 3 and a universal checkpoint of stage 2: 8 steps uninterrupted, saved after 4; the
    optimizer files converted, the fp32 ones deleted, expanded back, and DeepSpeed resumes from them."""
    pytest.importorskip("deepspeed")
    universal = load_tool("scripts", "make_zero_fixtures").universal
    launch = load_tool("scripts", "zero_worker").launch

    t0 = time.perf_counter()
    stages = ("1", "2", "3")  # one launch trains every stage (DeepSpeed starts once), one resumes them
    launch("--stage", *stages, "--steps", "8", "--save-at", "4", "--save-dir", str(tmp_path / "s{stage}"),
           "--losses", str(tmp_path / "full{stage}.json"))
    for stage in stages:
        save = tmp_path / f"s{stage}"
        masters = {p.name: zero_pickle.load(str(p)) for p in rank_files_at(save)}
        if stage == "2":
            universal(str(save / "global_step4"), str(save / "global_step4_universal"))
        ckptq.convert(str(save), min_size=MIN)
        for p in rank_files_at(save):
            os.unlink(p)
        ckptq.expand(str(save))
        for p in rank_files_at(save):
            assert len(compare(masters[p.name], zero_pickle.load(str(p)))) == 2  # fp32 master weights exact
    uni = tmp_path / "s2" / "global_step4_universal"
    ckptq.convert(str(uni), min_size=MIN)
    for p in uni.glob("zero/*/exp_avg*.pt"):
        os.unlink(p)
    ckptq.expand(str(uni))
    launch("--stage", *stages, "--steps", "8", "--load-dir", str(tmp_path / "s{stage}"),
           "--losses", str(tmp_path / "res{stage}.json"))
    for stage in stages:
        compare_losses(tmp_path / f"full{stage}.json", tmp_path / f"res{stage}.json", stage)
    launch("--stage", "2", "--steps", "8", "--load-dir", str(tmp_path / "s2"), "--losses",
           str(tmp_path / "res-universal.json"), "--universal")
    compare_losses(tmp_path / "full2.json", tmp_path / "res-universal.json", "2 universal")
    print(f"end to end, 3 stages + universal: {time.perf_counter() - t0:.0f} s")


def compare_losses(full, resumed, what):
    """The resumed run's losses (steps 4-7) against the uninterrupted run's: the first one exact (it depends
    only on the exact weights), the others within 1e-3 relative (the moments went through 8 bits)."""
    a, b = json.loads(full.read_text()), json.loads(resumed.read_text())
    assert list(b) == ["4", "5", "6", "7"]
    assert b["4"] == a["4"]
    for k in b:
        assert abs(b[k] - a[k]) <= 1e-3 * abs(a[k]), (what, k, a[k], b[k])


def rank_files_at(save):
    with open(save / "latest") as f:
        step = save / f.read().strip()
    return sorted(step / n for n in os.listdir(step) if n.endswith("_optim_states.pt"))
