"""Lightning's sharded checkpoints (``ModelParallelStrategy`` with ``fully_shard``: a ``last.ckpt/`` DCP
folder with ``optimizer_0.state.<name>.exp_avg`` keys and a ``meta.pt``), with real Lightning processes:
``ckptq convert`` of the folder gives one an ``AdamW8bit`` run resumes from, at another world size, with the
losses of a torch AdamW resume from the original to the 8-bit tolerance; ``expand`` gives torch AdamW one."""

import json
import subprocess
import sys

import pytest

from tests.helpers.paths import child_env

pytest.importorskip("lightning")


def fit(opt: str, devices: int, out, steps: int, resume=None) -> dict:
    # a module of the tests package: child_env() puts the checkout on PYTHONPATH (for Lightning's own ranks too)
    cmd = [sys.executable, "-m", "tests.workers.lightning_worker", opt, str(devices), str(out), str(steps)] + ([str(resume)] if resume else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=child_env(OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def ckptq(*args):
    """The ckptq command in this process (a process of its own would only add seconds of imports)."""
    from click.testing import CliRunner

    from ckptq.cli import main

    r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert r.exit_code == 0, r.output[-2000:]
    return r.stdout


def test_lightning_sharded_checkpoint_converts_resumes_8bit_and_expands(tmp_path):
    fit("adamw", 2, tmp_path / "run", 4)
    last = tmp_path / "run" / "last.ckpt"
    assert (last / ".metadata").is_file() and (last / "meta.pt").is_file()
    info = json.loads(ckptq("info", last, "--json"))
    fp32_moments = sum(r["tensors"] for r in info["states"]
                       if r["bits"] is None and r["role"] in ("exp_avg", "exp_avg_sq"))
    assert info["type"] == "dcp" and fp32_moments == 4 * 2  # 2 Linear layers: weight and bias
    ckptq("convert", last, "--min-size", 1024)
    q8 = tmp_path / "run" / "last.ckpt.q8"
    assert (q8 / "meta.pt").read_bytes() == (last / "meta.pt").read_bytes()
    assert sum(f.stat().st_size for f in q8.iterdir()) < 0.6 * sum(f.stat().st_size for f in last.iterdir())
    reference = fit("adamw", 1, tmp_path / "ref", 8, last)  # what an fp32 resume gives (world size 2 -> 1)
    resumed = fit("adamw8bit", 1, tmp_path / "q8run", 8, q8)
    assert resumed["step"] == reference["step"] == 8
    assert resumed["losses"] == pytest.approx(reference["losses"], rel=1e-4)  # 8-bit moments: ~1e-6 seen
    ckptq("expand", q8, "-o", tmp_path / "back.ckpt")
    back = json.loads(ckptq("info", tmp_path / "back.ckpt", "--json"))
    assert back["type"] == "dcp" and not any(r["bits"] for r in back["states"])
    assert (tmp_path / "back.ckpt" / "meta.pt").is_file()
