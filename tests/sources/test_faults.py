"""Faults while writing: a full disk for convert and expand, kill -9 at several points, and outputs
that do not depend on temp names. Each fault runs in a child process (a real write limit, a real
SIGKILL) and is judged from the outside."""

import os
import resource
import signal
import socket
import subprocess
import sys

import pytest
import torch

import ckptq
from ckptq.format.atomic import TMP_MARK, remove_stale_temps
from ckptq.kernels import native


@pytest.fixture
def ckpt(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 128))
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 128)).sum().backward()
    opt.step()
    path = tmp_path / "c.pt"
    torch.save({"model": m.state_dict(), "optimizer": opt.state_dict()}, path)
    return str(path)


def _limited(limit):
    def pre():  # a write past `limit` bytes fails with EFBIG, as a full disk fails with ENOSPC
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return pre


def _cli(args, limit=None, timeout=120):
    if limit:
        # The child builds the C kernels on first use, under the same write limit: 60 KB against a 24-52 KB
        # library here (by CPU), larger elsewhere; with a cold cache a second line (the build's warning)
        # then failed the test. Build or load them here first, as any earlier use would have.
        native._load.cache_clear()
        native.library()
    return subprocess.run([sys.executable, "-m", "ckptq", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, preexec_fn=_limited(limit) if limit else None)


def _temps(folder):
    return sorted(f for f in os.listdir(folder) if TMP_MARK in f)


@pytest.mark.parametrize("command", ["convert", "expand"])
def test_full_disk_is_one_line_and_leaves_nothing(command, ckpt, tmp_path):
    src = ckpt
    if command == "expand":
        src = str(tmp_path / "c.q8.safetensors")
        ckptq.convert(ckpt, src)
    before = sorted(os.listdir(tmp_path)), open(src, "rb").read()
    out = tmp_path / "out.bin"
    r = _cli([command, src, "-o", out, "-q"], limit=60_000)
    assert r.returncode == 7, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("ckptq: error: ") and "no output was written" in r.stderr
    assert "terminate" not in r.stderr and "Traceback" not in r.stderr
    assert (sorted(os.listdir(tmp_path)), open(src, "rb").read()) == before  # nothing left, input untouched


def test_expand_is_reproducible(ckpt, tmp_path):
    conv = str(tmp_path / "c.q8.safetensors")
    ckptq.convert(ckpt, conv)
    ckptq.expand(conv, str(tmp_path / "a.pt"))
    ckptq.expand(conv, str(tmp_path / "b.pt"))
    assert (tmp_path / "a.pt").read_bytes() == (tmp_path / "b.pt").read_bytes()
    assert torch.load(tmp_path / "a.pt", weights_only=True)["model"]["0.weight"].shape == (128, 128)


KILL = {  # where the child SIGKILLs itself: (module attribute to wrap, after how many calls)
    "convert, mid-tensor": ("ckptq.format.safetensors_io:_write_tensor", 3),
    "expand, mid-record": ("ckptq.format.torch_stream:_Sink.write", 6),
    "sharded overwrite, between renames": ("os:replace", 4),
}


def _killed_child(point, code):
    target, after = KILL[point]
    mod, attr = target.split(":")
    script = f"""
import importlib, os, signal
import ckptq
owner = importlib.import_module({mod!r})
*path, name = {attr!r}.split(".")
for p in path:
    owner = getattr(owner, p)
real, calls = getattr(owner, name), [0]
def wrapped(*a, **k):
    calls[0] += 1
    out = real(*a, **k)
    if calls[0] >= {after}:
        os.kill(os.getpid(), signal.SIGKILL)
    return out
setattr(owner, name, wrapped)
{code}
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr


@pytest.mark.parametrize("point", sorted(KILL))
def test_kill_9_leaves_recognisable_temps_that_the_next_write_removes(point, ckpt, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    dst = str(out / "c.q8.safetensors")
    if point.startswith("expand"):
        ckptq.convert(ckpt, str(tmp_path / "c.q8.safetensors"))
        code = f"ckptq.expand({str(tmp_path / 'c.q8.safetensors')!r}, {str(out / 'e.pt')!r})"
    elif point.startswith("sharded"):
        ckptq.convert(ckpt, dst, max_shard_size=40_000)
        code = f"ckptq.convert({ckpt!r}, {dst!r}, block_size=64, max_shard_size=40_000, force=True)"
    else:
        code = f"ckptq.convert({ckpt!r}, {dst!r})"
    _killed_child(point, code)
    temps = _temps(out)
    assert temps and all(t.startswith(".") and f"-{socket.gethostname()}-" in t for t in temps), os.listdir(out)
    if point.startswith("sharded"):  # one shard renamed, the others old: refused, not loaded
        with pytest.raises(ckptq.errors.FormatError, match="not the one this index was written with"):
            ckptq.load(str(out))
    else:
        assert [f for f in os.listdir(out) if not f.startswith(".")] == []  # nothing under a final name
    live = out / f".x{TMP_MARK}{socket.gethostname()}-{os.getpid()}-abc.tmp"  # a live writer's temp
    live.write_bytes(b"")
    ckptq.save({"a": torch.ones(2)}, str(out / "other.safetensors"))  # any later write into the folder
    assert _temps(out) == [live.name]


def test_cleanup_removes_only_temps_a_dead_run_recorded(tmp_path, monkeypatch):
    """A name proves nothing (a user's ``.report.txt.ckptq-tmp-<host>-4000000-mine.tmp`` was deleted by
    any convert into its folder): only a file a finished ckptq process recorded, still the same file
    (device, inode), is removed."""
    import json

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    host = socket.gethostname()
    lookalikes = [f".report.txt{TMP_MARK}{host}-4000000-mine.tmp", f".a{TMP_MARK}otherhost-1-abc.tmp",
                  f".a{TMP_MARK}{host}-1x-abc.tmp", "a.tmp", f"a{TMP_MARK}.txt"]
    for n in lookalikes:
        (tmp_path / n).write_bytes(b"the user's")
    recorded, replaced = tmp_path / f".c{TMP_MARK}{host}-4000001-x.tmp", tmp_path / f".d{TMP_MARK}{host}-4000001-y.tmp"
    recorded.write_bytes(b"left by a killed run")
    replaced.write_bytes(b"left by a killed run")
    entries = [{"path": str(p), "dev": p.stat().st_dev, "ino": p.stat().st_ino} for p in (recorded, replaced)]
    (tmp_path / "other").write_bytes(b"the user's, at the same name")
    os.replace(tmp_path / "other", replaced)  # another file (another inode) at that name now
    journal = tmp_path / "cache" / "ckptq" / "temps" / f"{host}-4000001-abcdef.jsonl"  # pid 4000001: gone
    journal.parent.mkdir(parents=True)
    journal.write_text("".join(json.dumps(e) + "\n" for e in entries))
    alive = journal.with_name(f"{host}-{os.getpid()}-abcdef.jsonl")  # this process: alive
    alive.write_text(json.dumps({"path": str(tmp_path / lookalikes[0]), "dev": 0, "ino": 0}) + "\n")
    ckptq.save({"a": torch.ones(2)}, str(tmp_path / "out.safetensors"))  # any write sweeps
    assert not recorded.exists() and replaced.read_bytes() == b"the user's, at the same name"
    assert all((tmp_path / n).read_bytes() == b"the user's" for n in lookalikes)
    assert not journal.exists() and alive.exists()
    assert remove_stale_temps() == []