"""Hostile torch.distributed.checkpoint folders: a folder someone else wrote
runs no code, reads nothing outside itself, never hangs, and every refusal is one line (InputError, exit 3),
in ``ckptq info`` / ``convert`` / ``expand``, under ``torchrun -m ckptq convert``, and in a user's own
``dcp.load`` through ``ckptq.dcp.SafeFileSystemReader`` and ``ckptq.dcp.LowBitLoadPlanner``."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex

import ckptq.dcp
from ckptq.cli import main
from ckptq.errors import InputError
from tests.helpers.hostile import DCP_KINDS, Runs, Shadowed, dcp_folder, edit_metadata, nested
from tests.helpers.paths import child_env


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def refused_by_cli(args, words):
    """``ckptq ARGS`` exits 3 with one line holding ``words``."""
    r = cli(*args)
    lines = r.output.strip().splitlines()
    assert r.exit_code == 3 and len(lines) == 1 and words in r.output, r.output
    assert "internal error" not in r.output and "[(" not in r.output, r.output


def all_commands_refuse(folder, words, tmp_path, quantized=None):
    """info, convert and expand (of ``quantized`` if given: a folder expand would otherwise read) each
    refuse in one line and write nothing."""
    refused_by_cli(["info", folder], words)
    refused_by_cli(["convert", folder, "-o", tmp_path / "q8"], words)
    refused_by_cli(["expand", quantized or folder, "-o", tmp_path / "fp32"], words)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(("q8", "fp32"))]


# --- item 1: a .metadata pickle that runs code -------------------------------------------------------------

def hostile_metadata(tmp_path):
    folder = dcp_folder(tmp_path / "src")
    marker = tmp_path / "RAN"
    edit_metadata(folder, lambda md: setattr(md, "planner_data", Runs(marker)))
    return folder, marker


def test_metadata_pickle_runs_no_code_in_info_convert_expand(tmp_path):
    folder, marker = hostile_metadata(tmp_path)
    all_commands_refuse(folder, "posix.mkdir", tmp_path)
    assert not marker.exists()


def test_metadata_pickle_runs_no_code_under_torchrun(tmp_path):
    folder, marker = hostile_metadata(tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "ckptq",
           "convert", str(folder), "-o", str(tmp_path / "out")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode != 0 and "posix.mkdir" in r.stderr, r.stderr[-2000:]
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_safe_reader_keeps_a_users_dcp_load_from_running_metadata_code(tmp_path):
    folder, marker = hostile_metadata(tmp_path)
    target = {"model": {"w": torch.empty(16, 256)}}
    with pytest.raises(CheckpointException, match=r"posix\.mkdir"):  # dcp.load wraps what its reader raised
        dcp.load(target, storage_reader=ckptq.dcp.SafeFileSystemReader(str(folder)),
                 planner=ckptq.dcp.LowBitLoadPlanner(), no_dist=True)
    assert not marker.exists()


def test_metadata_globals_are_matched_by_exact_name(tmp_path):
    """``torch.Size`` is admitted, ``torch.load`` (same module) is not: names match exactly."""
    folder = dcp_folder(tmp_path / "src")
    raw = (folder / ".metadata").read_bytes()
    assert raw.count(b"Size") == 1
    (folder / ".metadata").write_bytes(raw.replace(b"Size", b"load"))
    refused_by_cli(["info", folder], "needs torch.load, which DCP metadata never holds")


# --- containers whose pickled state hides entries from a check that iterates them ---------------------

def _hide_behind(where: str, name: str, target: str):
    """Point every stored item at ``target`` and pickle ``where`` (a Metadata field) as an OrderedDict whose
    instance state shadows ``name``: a check iterating ``.items()`` saw nothing, torch read by key."""
    def edit(md):
        for info in md.storage_data.values():
            info.relative_path = target
        # the entries are real (SETITEMS), then BUILD writes items = set: od.items() is set(), an empty iteration
        setattr(md, where, Shadowed((getattr(md, where) or {}).items(), {name: set}))
    return edit


@pytest.mark.parametrize("where", ["storage_data", "state_dict_metadata", "planner_data"])
@pytest.mark.parametrize("name", ["items", "keys", "values", "get", "__iter__", "__len__"])
def test_containers_with_shadowing_state_cannot_smuggle_a_path_outside(tmp_path, where, name):
    victim = dcp_folder(tmp_path / "victim")
    folder = dcp_folder(tmp_path / "src")
    edit_metadata(folder, _hide_behind(where, name, "../victim/__0_0.distcp"))
    all_commands_refuse(folder, "an OrderedDict with attributes", tmp_path)
    target = {"model": {"w": torch.empty(16, 256)}}
    with pytest.raises(CheckpointException, match="OrderedDict with attributes"):
        dcp.load(target, storage_reader=ckptq.dcp.SafeFileSystemReader(str(folder)), no_dist=True)
    assert (victim / "__0_0.distcp").exists()


@pytest.mark.parametrize("holder", ["index", "storage", "tensor", "chunk", "metadata"])  # TensorProperties pickles a tuple
def test_metadata_objects_with_state_beyond_their_fields_are_refused(tmp_path, holder):
    folder = dcp_folder(tmp_path / "src")

    def edit(md):
        index, info = next(iter(md.storage_data.items()))
        tensor = next(m for m in md.state_dict_metadata.values() if hasattr(m, "chunks"))
        obj = {"index": index, "storage": info, "tensor": tensor, "chunk": tensor.chunks[0],
               "metadata": md}[holder]
        obj.__dict__["relative_path_"] = "/etc/passwd"
    edit_metadata(folder, edit)
    all_commands_refuse(folder, "with attributes ['relative_path_']", tmp_path)


@pytest.mark.parametrize("field, value, words", [
    ("storage_data", [], "list where a dict belongs"),
    ("state_dict_metadata", {1: None}, "a key of type int"),
    ("planner_data", {"k": torch.Size([1])}, "Size in plain data"),
])
def test_metadata_fields_of_the_wrong_type_are_refused(tmp_path, field, value, words):
    folder = dcp_folder(tmp_path / "src")
    edit_metadata(folder, lambda md: setattr(md, field, value))
    refused_by_cli(["info", folder], words)


# --- item 2: a byte entry (optimizer.param_groups.0.lr) that runs code --------------------------------------

def test_byte_entry_pickle_runs_no_code_in_info_convert_expand(tmp_path):
    marker = tmp_path / "RAN"
    folder = dcp_folder(tmp_path / "src", lr=Runs(marker))
    quantized = dcp_folder(tmp_path / "src8", lr=Runs(marker), quantized=True)
    all_commands_refuse(folder, "posix.mkdir", tmp_path, quantized)
    assert not marker.exists()


def test_load_planner_reads_byte_entries_without_running_code(tmp_path):
    """A user's own dcp.load with ckptq.dcp.LowBitLoadPlanner, with or without the safe reader."""
    marker = tmp_path / "RAN"
    folder = dcp_folder(tmp_path / "src", lr=Runs(marker))
    template = {"optimizer": {"state": {}, "param_groups": [{"lr": 0.0, "params": ["w"]}]}}
    for reader in (dcp.FileSystemReader(str(folder)), ckptq.dcp.SafeFileSystemReader(str(folder))):
        with pytest.raises((InputError, CheckpointException), match=r"posix\.mkdir"):
            dcp.load(template, storage_reader=reader, planner=ckptq.dcp.LowBitLoadPlanner(), no_dist=True)
        assert not marker.exists()


def test_honest_byte_entries_load_through_the_safe_planner(tmp_path):
    folder = dcp_folder(tmp_path / "src")
    template = {"optimizer": {"state": {}, "param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": ["w"]}]}}
    dcp.load(template, storage_reader=ckptq.dcp.SafeFileSystemReader(str(folder)),
             planner=ckptq.dcp.LowBitLoadPlanner(), no_dist=True)
    assert template["optimizer"]["param_groups"][0]["lr"] == 1e-3
    assert tuple(template["optimizer"]["param_groups"][0]["betas"]) == (0.9, 0.999)


def test_deeply_nested_byte_entry_is_one_line(tmp_path):
    folder = dcp_folder(tmp_path / "src", lr=nested(600))
    quantized = dcp_folder(tmp_path / "src8", lr=nested(600), quantized=True)
    all_commands_refuse(folder, "nested", tmp_path, quantized)


# --- item 6: FIFOs, paths outside the folder, absurd sizes --------------------------------------------------

def run_isolated(calls: str, timeout=120) -> list[str]:
    """Run each ckptq call (Python expressions, one a line) in a child with a time limit: a hang fails
    the test instead of blocking it. Returns 'REFUSED <message>' / 'OK' per call."""
    script = ("import ckptq, ckptq.dcp\nfrom ckptq.errors import InputError\n"
              "for call in [" + ",".join(f"lambda: {c}" for c in calls.strip().splitlines()) + "]:\n"
              "    try:\n        call(); print('OK')\n"
              "    except InputError as e:\n        print('REFUSED', e)\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.splitlines()


def _fifo_folders(root) -> dict:
    """The folders of the FIFO tests below and the ckptq calls each test makes on them: name -> (its folder
    of outputs, the calls)."""
    scenarios = {}
    for how in ("fifo", "symlink"):  # a FIFO as a data file, or a data file that links to one
        tmp = root / how
        folder = dcp_folder(tmp / "src")
        data = folder / "__0_0.distcp"
        data.unlink()
        if how == "fifo":
            os.mkfifo(data)
        else:
            os.mkfifo(tmp / "pipe")
            data.symlink_to(tmp / "pipe")
        scenarios[how] = tmp, [f"ckptq.info({str(folder)!r})", f"ckptq.convert({str(folder)!r}, {str(tmp / 'q8')!r})",
                               f"ckptq.expand({str(folder)!r}, {str(tmp / 'fp32')!r})"]
    run = root / "accelerate" / "checkpoint"  # an accelerate run's folder with a FIFO in optimizer_0/
    run.mkdir(parents=True)
    folder = dcp_folder(run / "optimizer_0")
    (folder / "__0_0.distcp").unlink()
    os.mkfifo(folder / "__0_0.distcp")
    scenarios["accelerate"] = run.parent, [f"ckptq.info({str(run)!r})", f"ckptq.convert({str(run)!r})"]
    tmp = root / "companion"  # a FIFO in a companion folder
    folder = dcp_folder(tmp / "src")
    (folder / "extra").mkdir()
    (folder / "extra" / "notes.txt").write_text("kept")
    os.mkfifo(folder / "extra" / "pipe")
    scenarios["companion"] = tmp, [f"ckptq.convert({str(folder)!r}, {str(tmp / 'out')!r})"]
    return scenarios


@pytest.fixture(scope="module")
def fifo_runs(tmp_path_factory):
    """Every FIFO test's calls in one child with a time limit (a hang fails them instead of blocking them; a
    child of its own each would cost seconds of imports each): name -> (its folder, one line per call)."""
    scenarios = _fifo_folders(tmp_path_factory.mktemp("fifos"))
    out = run_isolated("\n".join(call for _, calls in scenarios.values() for call in calls))
    got, at = {}, 0
    for name, (tmp, calls) in scenarios.items():
        got[name], at = (tmp, out[at:at + len(calls)]), at + len(calls)
    assert at == len(out), out
    return got


@pytest.mark.parametrize("how", ["fifo", "symlink"])
def test_fifo_data_file_never_hangs(fifo_runs, how):
    tmp_path, out = fifo_runs[how]  # info, convert and expand of the folder
    assert len(out) == 3 and all(ln.startswith("REFUSED") and "FIFO" in ln for ln in out), out
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(("q8", "fp32"))]


def test_fifo_in_an_accelerate_optimizer_folder_never_hangs(fifo_runs):
    out = fifo_runs["accelerate"][1]  # info and convert of the run's folder
    assert len(out) == 2 and all(ln.startswith("REFUSED") and "FIFO" in ln for ln in out), out


def test_fifo_in_a_companion_folder_is_one_line_and_leaves_no_temp_folder(fifo_runs):
    tmp_path, out = fifo_runs["companion"]  # convert of the folder
    assert len(out) == 1 and out[0].startswith("REFUSED") and "pipe" in out[0] and "FIFO" in out[0], out
    assert "[(" not in out[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_companion_files_and_folders_are_still_copied(tmp_path):
    folder = dcp_folder(tmp_path / "src")
    (folder / "meta.pt").write_bytes(b"loop state")
    (folder / "sub").mkdir()
    (folder / "sub" / "a.txt").write_text("a")
    assert cli("convert", folder, "-o", tmp_path / "out").exit_code == 0
    assert (tmp_path / "out" / "meta.pt").read_bytes() == b"loop state"
    assert (tmp_path / "out" / "sub" / "a.txt").read_text() == "a"


def _point_data_at(name):
    def edit(md):
        for info in md.storage_data.values():
            info.relative_path = name
    return edit


@pytest.mark.parametrize("name", ["/etc/passwd", "../outside.distcp", "sub/../../outside.distcp", "sub/x.distcp"])
def test_metadata_may_name_only_files_in_its_own_folder(tmp_path, name):
    folder = dcp_folder(tmp_path / "src")
    shutil.copy(folder / "__0_0.distcp", tmp_path / "outside.distcp")  # a real DCP file, outside the folder
    (folder / "sub").mkdir()
    shutil.copy(folder / "__0_0.distcp", folder / "sub" / "x.distcp")
    edit_metadata(folder, _point_data_at(name))
    all_commands_refuse(folder, "only name files in its own folder", tmp_path)


def _resize(key, size, chunk_sizes=None):
    """Give tensor ``key`` the size ``size`` and its one chunk ``chunk_sizes`` (default: the same), at
    offsets 0 (its stored data keyed by them)."""
    def edit(md):
        m = md.state_dict_metadata[key]
        chunk = m.chunks[0]
        info = md.storage_data.pop(MetadataIndex(key, chunk.offsets))
        m.size, chunk.sizes = torch.Size(size), torch.Size(chunk_sizes or size)
        chunk.offsets = torch.Size([0] * len(chunk.sizes))
        md.storage_data[MetadataIndex(key, chunk.offsets)] = info
    return edit


@pytest.mark.parametrize("edit, words", [
    (_resize("optimizer.state.w.exp_avg", (2**20, 2**20)), "stored in"),  # 2**40 elements in 16 KiB
    (_resize("optimizer.state.w.step", (2**40,)), "stored in"),
    (_resize("optimizer.state.w.exp_avg", (2**25, 2**24)), "more than 2**48"),
    (_resize("optimizer.state.w.exp_avg", (-16, 256)), "negative"),
    (_resize("optimizer.state.w.exp_avg", (16, 256), (8, 256)), "cover"),
    (_resize("optimizer.state.w.exp_avg", (16, 256), (16, 512)), "outside"),
    (_resize("optimizer.state.w.exp_avg", (16, 256), (16,)), "dimensions"),
])
def test_absurd_sizes_are_one_line_input_errors(tmp_path, edit, words):
    folder = dcp_folder(tmp_path / "src")
    edit_metadata(folder, edit)
    all_commands_refuse(folder, words, tmp_path)


def test_overlapping_chunks_are_refused(tmp_path):
    """Two chunks over the same rows (the volume adds up, the rows do not): part of the tensor would be
    uninitialized memory in the output."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    folder = dcp_folder(tmp_path / "src")

    def edit(md):
        key = "optimizer.state.w.exp_avg"
        m = md.state_dict_metadata[key]
        m.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([8, 256])),
                    ChunkStorageMetadata(torch.Size([4, 0]), torch.Size([8, 256]))]
        whole = md.storage_data[MetadataIndex(key, torch.Size([0, 0]))]
        md.storage_data[MetadataIndex(key, torch.Size([4, 0]))] = whole
    edit_metadata(folder, edit)
    refused_by_cli(["info", folder], "overlap")


def test_data_beyond_the_end_of_its_file_is_refused(tmp_path):
    folder = dcp_folder(tmp_path / "src")

    def edit(md):
        for info in md.storage_data.values():
            info.offset += 10**9
    edit_metadata(folder, edit)
    all_commands_refuse(folder, "beyond the end", tmp_path)


@pytest.mark.parametrize("field, value", [("shape", "x"), ("shape", [-1, 256]), ("shape", [2**40]), ("shape", None),
                                          ("shape", [16.5, 2]), ("divisor", "nope")])
def test_crafted_8bit_state_scalars_are_one_line_input_errors(tmp_path, field, value):
    """expand allocates an 8-bit state's output by its shape and pairs a ratio with its divisor before any
    decoder checks them: odd values were TypeError / RuntimeError tracebacks or a 4 TiB allocation."""
    def edit(pstate):
        pstate["exp_avg"] = {**pstate["exp_avg"], field: value}
    folder = dcp_folder(tmp_path / "src", quantized=True, edit=edit)
    refused_by_cli(["expand", folder, "-o", tmp_path / "fp32"], "it is damaged or crafted")
    assert not (tmp_path / "fp32").exists()


def test_honest_folder_info_convert_expand_still_work(tmp_path):
    folder = dcp_folder(tmp_path / "src")
    r = cli("info", folder, "--json")
    assert r.exit_code == 0 and sum(w["tensors"] for w in json.loads(r.output)["would_store"]) == 2, r.output
    assert cli("convert", folder, "-o", tmp_path / "q8").exit_code == 0
    assert cli("expand", tmp_path / "q8", "-o", tmp_path / "fp32").exit_code == 0
    back = {"optimizer": {"state": {"w": {"exp_avg": torch.empty(16, 256)}}}}
    dcp.load(back, storage_reader=ckptq.dcp.SafeFileSystemReader(str(tmp_path / "fp32")), no_dist=True)
    assert back["optimizer"]["state"]["w"]["exp_avg"].abs().sum() > 0


def test_dcp_campaign_runs_no_code_never_hangs_and_refuses_in_one_line(tmp_path):
    """Bit flips and truncations of .metadata and .distcp, crafted metadata values, crafted pickles in
    .metadata and in byte entries, odd 8-bit state fields, FIFOs, containers and objects whose pickled
    state hides entries: 25 folders of each kind, in a child
    with a time limit."""
    code = ("import json, logging, warnings; from tests.helpers import hostile; "
            "warnings.filterwarnings('ignore'); logging.disable(logging.CRITICAL); "
            f"print(json.dumps(hostile.dcp_campaign(25, 2026, {str(tmp_path)!r})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
    # env: the checkout on PYTHONPATH, so that the child imports tests.helpers whatever its cwd
                       env=child_env())
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.splitlines()[-1])
    assert res.pop("examples") == []
    for kind in DCP_KINDS:
        assert sum(res[kind].values()) == 25 and set(res[kind]) <= {"refused", "loaded"}, (kind, res[kind])
    for kind in ("truncate", "pickle", "entry", "shadow"):  # each of these must be refused by every command
        assert res[kind] == {"refused": 25}, (kind, res[kind])


def test_olmo_core_storage_info_is_read_by_name_without_importing_olmo_core(tmp_path, monkeypatch):
    """OLMo-core's .metadata names its own _StorageInfo (torch's three fields): read as data, the folder
    converts, and nothing named olmo_core is imported."""
    import dataclasses
    import pickle
    import types

    name = "olmo_core.distributed.checkpoint.filesystem"

    @dataclasses.dataclass
    class _StorageInfo:
        relative_path: str
        offset: int
        length: int

    module = types.ModuleType(name)
    _StorageInfo.__module__, _StorageInfo.__qualname__ = name, "_StorageInfo"
    module._StorageInfo = _StorageInfo
    folder = dcp_folder(tmp_path / "src")
    with monkeypatch.context() as m:  # only while pickling: the reader must not find it
        for i, _ in enumerate(name.split(".")):
            m.setitem(sys.modules, ".".join(name.split(".")[: i + 1]), types.ModuleType(name))
        m.setitem(sys.modules, name, module)
        path = folder / ".metadata"
        md = pickle.loads(path.read_bytes())
        md.storage_data = {k: _StorageInfo(v.relative_path, v.offset, v.length) for k, v in md.storage_data.items()}
        path.write_bytes(pickle.dumps(md))
    assert b"olmo_core" in path.read_bytes()
    assert cli("convert", folder, "-o", tmp_path / "q8").exit_code == 0
    assert not [m for m in sys.modules if m.startswith("olmo_core")]
    back = {"optimizer": {"state": {"w": {"exp_avg": torch.empty(16, 256)}}}}
    dcp.load(back, storage_reader=ckptq.dcp.SafeFileSystemReader(str(folder)), no_dist=True)
    assert back["optimizer"]["state"]["w"]["exp_avg"].abs().sum() > 0


# --- small metadata that claims much, or costs quadratic time --------------------------------------------

def _strips(key: str, a: int, shared_bytes: bool, data_file: str | None = None):
    """Tensor ``key`` as ``a`` row strips of its left half plus ``a`` column strips of its right half
    (2a chunks that form no grid), each chunk's data the first bytes of the file (``shared_bytes``) or
    its own range (in ``data_file``, if given)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    def edit(md):
        m = md.state_dict_metadata[key]
        info = next(v for k, v in md.storage_data.items() if k.fqn == key)
        for k in [k for k in md.storage_data if k.fqn == key]:
            del md.storage_data[k]
        m.size = torch.Size([a, 2 * a])
        m.chunks = [ChunkStorageMetadata(torch.Size([i, 0]), torch.Size([1, a])) for i in range(a)]
        m.chunks += [ChunkStorageMetadata(torch.Size([0, a + j]), torch.Size([a, 1])) for j in range(a)]
        for n, c in enumerate(m.chunks):
            offset = 0 if shared_bytes else n * a * 4
            md.storage_data[MetadataIndex(key, c.offsets)] = _StorageInfo(data_file or info.relative_path, offset, a * 4)
    return edit


def test_chunks_that_share_their_bytes_are_refused_before_anything_is_allocated(tmp_path):
    """20,000 chunks all stored in the same 40 KB: a 2 MB folder claimed 800 MB (and took minutes to check)."""
    folder = dcp_folder(tmp_path / "src")
    edit_metadata(folder, _strips("optimizer.state.w.exp_avg", 10_000, shared_bytes=True))
    r = subprocess.run([sys.executable, "-m", "ckptq", "info", str(folder)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 3 and "stored in the same bytes" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr


def test_many_chunks_that_form_no_grid_are_checked_in_n_log_n(tmp_path):
    """4,000 strips with bytes of their own (64 MB) read as one tensor: no quadratic check in between."""
    folder = dcp_folder(tmp_path / "src")
    key = "optimizer.state.w.exp_avg"
    a = 2_000
    data = torch.arange(a * a * 2, dtype=torch.float32)
    edit_metadata(folder, _strips(key, a, shared_bytes=False, data_file="strips.distcp"))
    with open(folder / "strips.distcp", "wb") as f:
        f.write(data.numpy().tobytes())
    from ckptq.dcp import safe_reader

    md = safe_reader.load_metadata(str(folder))
    assert len(md.state_dict_metadata[key].chunks) == 2 * a


def test_param_groups_are_indexed_once_not_searched_per_parameter():
    """2,000 moment pairs x 2,000 param_groups.N.params lists x 1,000 names: info took minutes searching
    every list for every parameter. The index is built in one pass (here 400 lists of 500 names); the first
    group naming a parameter wins."""
    from ckptq.dcp import folder

    scalars = {f"optimizer.param_groups.{g}.params": [f"p{g * 500 + i}" for i in range(500)] for g in range(400)}
    scalars["optimizer.param_groups.399.params"].append("p5")  # named twice: group 0 names it first
    scalars |= {f"optimizer.param_groups.{g}.eps": float(g) for g in range(400)}
    groups = folder._group_of(scalars)
    assert len(groups) == 200_000
    assert folder._group_value(scalars, groups, "optimizer", "p5", "eps", None) == 0.0
    assert folder._group_value(scalars, groups, "optimizer", "p199999", "eps", None) == 399.0
    assert folder._group_value(scalars, groups, "optimizer", "nope", "eps", 1e-8) == 1e-8
