"""Hostile DeepSpeed ZeRO checkpoints: ckptq reads only the globals DeepSpeed
writes, with plain arguments and state, and writes nothing else back (DeepSpeed loads its files with full
unpickling, so an expanded file must hold nothing a crafted input put there); ``latest`` names a folder
beside it; deeply nested pickles are one-line errors. Fixtures: tests/fixtures/zero (see
tests/deepspeed/test_zero.py)."""

import collections
import io
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from ckptq.cli import main
from ckptq.deepspeed import objects as zero_pickle
from ckptq.errors import FormatError
from tests.helpers.hostile import ZERO_KINDS, CraftingPickler, edit_skeleton
from tests.helpers import paths
from tests.helpers.paths import child_env

FIXTURES = os.path.join(paths.FIXTURES, "zero")
MIN = 256
STAGE = "deepspeed.runtime.zero.config.ZeroStageEnum"


def copy(tmp_path, name="zero2"):
    return shutil.copytree(os.path.join(FIXTURES, name), tmp_path / name)


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def refused(args, words, code=3):
    r = cli(*args)
    lines = r.output.strip().splitlines()
    assert r.exit_code == code and len(lines) == 1 and words in r.output, r.output
    assert "internal error" not in r.output, r.output


def rank_files(save, suffix=".pt"):
    step = save / "global_step3"
    return sorted(step / n for n in os.listdir(step) if n.endswith("_optim_states" + suffix))


def rewrite(path, obj, depth_needed=False):
    """Save ``obj`` over ``path`` with any globals, as a crafted file would."""
    from ckptq.format import torch_stream

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20_000) if depth_needed else limit)
    try:
        torch_stream.save(obj, f"{path}.new", pickler=CraftingPickler)
    finally:
        sys.setrecursionlimit(limit)
    os.replace(f"{path}.new", path)


def converted(tmp_path):
    """zero2 converted, its fp32 rank files removed (expand writes them back)."""
    save = copy(tmp_path)
    assert cli("convert", save, "--min-size", MIN).exit_code == 0
    for p in rank_files(save):
        p.unlink()
    return save


def rename_object(q8, old: str, new: str) -> None:
    """Replace DeepSpeed object name ``old`` by ``new`` in a converted file, sealed again as a writer would."""
    edit_skeleton(str(q8), lambda sk: json.dumps(sk).replace(json.dumps(old), json.dumps(new)))


# --- item 3: what expand writes back into a file DeepSpeed unpickles --------------------------------------

def test_object_name_with_injected_opcodes_is_refused_and_nothing_is_written(tmp_path):
    """The issue's reproducer: a name whose newlines end the GLOBAL opcode early and append a call to
    posix.mkdir. Before the fix expand exited 0 and the .pt ran mkdir under DeepSpeed's torch.load."""
    save = converted(tmp_path)
    marker = str(tmp_path / "RAN")
    assert "." not in marker  # the name is split at its last dot: the payload must hold none
    module = STAGE.rpartition(".")[0]
    injected = f"{module}\nZeroStageEnum\n0cposix\nmkdir\n(V{marker}\ntR0c{STAGE}"
    rename_object(rank_files(save, ".q8.safetensors")[0], STAGE, injected)
    refused(["expand", save], "which is not one DeepSpeed writes", code=5)
    assert rank_files(save) == [] and not os.path.exists(marker)


@pytest.mark.parametrize("name", ["deepspeed.runtime.engine.DeepSpeedEngine", "posix.system",
                                  "deepspeed.runtime.zero.config.ZeroStageEnum2", "deepspeed.runtime.zero.config"])
def test_converted_file_naming_another_global_is_refused(tmp_path, name):
    save = converted(tmp_path)
    rename_object(rank_files(save, ".q8.safetensors")[0], STAGE, name)
    refused(["expand", save], "which is not one DeepSpeed writes", code=5)
    assert rank_files(save) == []


def test_converted_object_with_arguments_of_other_types_is_refused(tmp_path):
    """ZeroStageEnum called with a torch.device instead of an int: DeepSpeed's objects hold plain values."""
    save = converted(tmp_path)

    def edit(sk):
        text = json.dumps(sk, separators=(",", ":"))
        before = f'"{STAGE}"],["called",true],["args",{{"list":[2]}}]'
        assert before in text
        return text.replace(before, f'"{STAGE}"],["called",true],["args",{{"list":[{{"device":"cpu"}}]}}]')
    edit_skeleton(str(rank_files(save, ".q8.safetensors")[0]), edit)
    refused(["expand", save], "arguments or state of other types", code=5)
    assert rank_files(save) == []


def test_pickler_writes_only_listed_names_of_safe_characters():
    """The last line of defence, below from_plain: the writer itself refuses."""
    for name in (f"{STAGE}\nposix\nsystem", "deepspeed.runtime.engine.DeepSpeedEngine", "deepspeed.a b.C"):
        cls = zero_pickle._standin(name)
        with pytest.raises(FormatError, match="refusing to write the global"):
            zero_pickle.Pickler(io.BytesIO(), protocol=2).dump(cls.__new__(cls))
    with pytest.raises(FormatError, match="'posix.system'"):
        zero_pickle.Pickler(io.BytesIO(), protocol=2).dump({"x": os.system})
    ok = zero_pickle._standin(STAGE)
    zero_pickle.Pickler(io.BytesIO(), protocol=2).dump({"s": ok(2), "t": torch.zeros(2), "d": torch.float16,
                                                        "o": collections.OrderedDict(a=1)})


def test_rank_file_with_a_deepspeed_global_not_on_the_list_is_refused(tmp_path):
    save = copy(tmp_path)
    path = rank_files(save)[0]
    obj = zero_pickle.load(str(path))
    engine = zero_pickle._standin("deepspeed.runtime.engine.DeepSpeedEngine")
    obj["optimizer_state_dict"]["engine"] = engine.__new__(engine)
    rewrite(path, obj)
    refused(["info", save, "--min-size", MIN], "needs arbitrary unpickling of deepspeed.runtime.engine.DeepSpeedEngine")
    refused(["convert", save, "--min-size", MIN], "needs arbitrary unpickling of deepspeed.runtime.engine.DeepSpeedEngine")
    assert rank_files(save, ".q8.safetensors") == []


@pytest.mark.parametrize("field, value", [("args", (torch.device("cpu"),)), ("state", {"cur_scale": torch.Size([2])}),
                                          ("state", {"not an identifier": 1.0}), ("args", None)])
def test_rank_file_objects_with_values_of_other_types_are_refused(tmp_path, field, value):
    """Arguments and state of DeepSpeed's objects: numbers, strings, bools, None, dtypes, tensors and
    lists/tuples/dicts of them; a nested DeepSpeed object (``args`` None: one as its argument) is refused."""
    save = copy(tmp_path)
    path = rank_files(save)[0]
    obj = zero_pickle.load(str(path))
    stage = obj["optimizer_state_dict"]["zero_stage"]
    if value is None:
        value = (zero_pickle._standin(STAGE)(2),)
    if field == "args":
        stage._args = value
    else:
        stage._state = value
    rewrite(path, obj)
    refused(["convert", save, "--min-size", MIN], f"{STAGE} is given {'arguments' if field == 'args' else 'state'}")
    assert rank_files(save, ".q8.safetensors") == []


def test_zero_stage_called_with_a_list_is_no_stage_not_a_traceback(tmp_path):
    """Found by the campaign: info put ZeroStageEnum's argument into a set of stages (TypeError)."""
    save = copy(tmp_path)
    for path in rank_files(save):
        obj = zero_pickle.load(str(path))
        obj["optimizer_state_dict"]["zero_stage"]._args = ([2],)
        rewrite(path, obj)
    r = cli("info", save, "--min-size", MIN, "--json")
    assert r.exit_code == 0 and json.loads(r.output)["details"]["stage"] is None, r.output


# --- item 10: latest, deep nesting ------------------------------------------------------------------------

@pytest.mark.parametrize("tag", ["..", ".", "/etc", "global_step3/..", "..\\global_step3", "global_step3\0"])
def test_latest_naming_anything_but_a_folder_beside_it_is_refused(tmp_path, tag):
    """``latest`` of '..' made convert read and write the save folder's parent."""
    parent = tmp_path / "runs"
    save = copy(parent)
    for p in rank_files(save):  # the parent holds rank files too: what '..' reached
        shutil.copy(p, parent / p.name)
    (save / "latest").write_bytes(tag.encode())
    refused(["convert", save, "--min-size", MIN], "which is not a folder name")
    assert not [n for n in os.listdir(parent) if n.endswith(".safetensors")]


@pytest.mark.parametrize("command", ["info", "convert"])
def test_deeply_nested_rank_file_is_one_line(tmp_path, command):
    save = copy(tmp_path)
    path = rank_files(save)[0]
    obj = zero_pickle.load(str(path))
    deep: list = []
    for _ in range(600):
        deep = [deep]
    obj["optimizer_state_dict"]["deep"] = deep
    rewrite(path, obj, depth_needed=True)
    refused([command, save, "--min-size", MIN], "nested more than 100 levels deep")


def test_self_containing_list_in_a_rank_file_is_one_line(tmp_path):
    save = copy(tmp_path)
    path = rank_files(save)[0]
    obj = zero_pickle.load(str(path))
    loop: list = []
    loop.append(loop)
    obj["optimizer_state_dict"]["loop"] = loop
    rewrite(path, obj)
    refused(["convert", save, "--min-size", MIN], "contains itself")


def _universal(tmp_path, name, obj):
    """zero2's universal checkpoint with zero/0.weight/``name`` replaced by ``obj`` (torch.save)."""
    uni = shutil.copytree(os.path.join(FIXTURES, "zero2", "global_step3_universal"), tmp_path / "uni")
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)  # a deeply nested object pickles only with a deeper stack
    try:
        torch.save(obj, uni / "zero" / "0.weight" / name)
    finally:
        sys.setrecursionlimit(limit)
    return uni


def test_deeply_nested_universal_moment_file_is_one_line(tmp_path):
    deep: list = []
    for _ in range(600):
        deep = [deep]
    moment = torch.load(os.path.join(FIXTURES, "zero2", "global_step3_universal", "zero", "0.weight", "exp_avg.pt"),
                        weights_only=True)
    uni = _universal(tmp_path, "exp_avg.pt", {**moment, "deep": deep})
    refused(["info", uni, "--min-size", 16], "nested more than 100 levels deep")
    refused(["convert", uni, "--min-size", 16], "nested more than 100 levels deep")


def test_universal_parameter_file_that_is_not_a_dict_is_one_line(tmp_path):
    uni = _universal(tmp_path, "fp32.pt", [1])
    refused(["info", uni, "--min-size", 16], "is not a universal checkpoint parameter file")


def test_honest_fixtures_still_convert_and_expand(tmp_path):
    for name in ("zero1", "zero3", "zero2_bf16"):
        save = copy(tmp_path, name)
        assert cli("convert", save, "--min-size", MIN).exit_code == 0
        for p in rank_files(save):
            p.unlink()
        r = cli("expand", save)
        assert r.exit_code == 0 and len(rank_files(save)) == 2, r.output


def test_zero_campaign_runs_no_code_writes_nothing_unsafe_and_refuses_in_one_line(tmp_path):
    """Bit flips and truncations of rank files, odd arguments and state of DeepSpeed's objects, foreign
    and injected global names, deep and self-containing nesting, odd ``latest`` tags, and crafted objects
    in converted files (whose expanded .pt files may then hold only DeepSpeed's globals): 20 of each."""
    code = ("import json, warnings; from tests.helpers import hostile; "
            "warnings.filterwarnings('ignore'); "
            f"print(json.dumps(hostile.zero_campaign(20, 2026, {str(tmp_path)!r})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
    # env: the checkout on PYTHONPATH, so that the child imports tests.helpers whatever its cwd
                       env=child_env())
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.splitlines()[-1])
    assert res.pop("examples") == []
    for kind in ZERO_KINDS:
        assert sum(res[kind].values()) == 20 and set(res[kind]) <= {"refused", "loaded"}, (kind, res[kind])
    for kind in ("globals", "nesting", "latest"):  # each of these must be refused by every command
        assert res[kind] == {"refused": 20}, (kind, res[kind])


# --- the set of rank files ---------------------------------------------------------------------------

@pytest.mark.parametrize("stray", ["zero_pp_rank_01_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_0_optim_states.pt",
                                   "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"])
def test_a_stray_rank_file_that_shadows_a_rank_is_refused(tmp_path, stray):
    """A stray zero_pp_rank_01_* shadowed rank 1: the real rank-1 file was silently not converted."""
    save = copy(tmp_path)
    step = save / "global_step3"
    shutil.copy(step / "zero_pp_rank_0_mp_rank_00_optim_states.pt", step / stray)
    before = sorted(os.listdir(step))
    for args in (["info", save], ["convert", save], ["expand", save]):
        refused(args, "move")
    assert sorted(os.listdir(step)) == before


@pytest.mark.parametrize("target", ["/dev/zero", "folder"])
def test_a_rank_file_that_is_not_a_regular_file_is_refused(tmp_path, target):
    """A rank file symlinked to /dev/zero was silently skipped (as if converted already)."""
    save = copy(tmp_path)
    rank1 = save / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    rank1.unlink()
    if target == "folder":
        rank1.mkdir()
    else:
        rank1.symlink_to(target)
    for args in (["info", save], ["convert", save]):
        refused(args, "is not a regular file")
