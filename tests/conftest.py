import copy
import functools
import io
import os
import sys

import pytest
import torch

from ckptq.kernels import native
from tests.helpers.models import TinyLM, param_groups, train

# One build of the C kernels for the whole run, where they are cached by default: tests that point
# XDG_CACHE_HOME at a folder of their own (for ckptq's journals) would otherwise send every process they
# start to compile the kernels again (~20 s each). Tests of the cache itself set CKPTQ_CACHE_DIR themselves.
os.environ.setdefault("CKPTQ_CACHE_DIR", str(native.cache_dir()))

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through Triton's interpreter; it must be chosen before any
    # @triton.jit function is created, so set it before any test module imports a kernel.
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Test modules that start process groups (torchrun, Lightning's or DeepSpeed's launchers): each launch takes
# a free port by binding one and releasing it, which a launch running at the same moment can take too. Under
# pytest-xdist (`make test` runs two workers) these modules form one scope, run one after another on one
# worker; every other module is a scope of its own, so its module-scoped fixtures are made once.
# tests/project/test_layout.py checks that every module that launches is listed, and only those.
LAUNCHING = ("tests/dcp/test_distributed.py", "tests/dcp/test_lightning_sharded.py", "tests/deepspeed/test_zero.py",
             "tests/hostile/test_hostile_dcp.py", "tests/project/test_readme_recipes.py",
             "tests/sources/test_first_hour.py")


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: without xdist, never called
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "launching" if module in LAUNCHING else module

    return Scheduling(config, log)


@pytest.fixture(autouse=True)
def fresh_bitsandbytes_overrides():
    """bitsandbytes keeps per-parameter overrides in a process-wide singleton keyed by (group, index), and
    never clears them: after transformers' Trainer registers its embedding for 32-bit state, the first
    parameter of every later bitsandbytes optimizer in the process keeps fp32 state. Each test starts clean."""
    yield
    bnb = sys.modules.get("bitsandbytes.optim.optimizer")
    if bnb is not None:
        bnb.GlobalOptimManager.get_instance().initialize()


@pytest.fixture
def eager_torchao(monkeypatch):
    """torchao's optimizers step eagerly: the same states and arithmetic as their compiled step, without
    minutes of C++ compilation per parameter shape."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)


@functools.cache
def _trained() -> tuple[bytes, TinyLM, torch.optim.AdamW, torch.Tensor]:
    """trained_ckpt's training, done once: (ckpt.pt's bytes, model, optimizer, the RNG state after it)."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2, betas=(0.9, 0.95))
    train(model, opt, 20)
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "model_args": {"vocab": 96, "dim": 64},
            "iter_num": 20, "best_val_loss": torch.tensor(3.25), "config": {"lr": 1e-2, "compile": False}}
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    return buf.getvalue(), model, opt, torch.get_rng_state()


@pytest.fixture
def trained_ckpt(tmp_path):
    """A nanoGPT-style ckpt.pt after a few AdamW steps: (path, model, optimizer). Trained once per session:
    each test gets the file in its own tmp_path, its own copies of the model and optimizer, and the global
    RNG where the training left it, as if it had trained them itself."""
    data, model, opt, rng = _trained()
    path = tmp_path / "ckpt.pt"
    path.write_bytes(data)
    model, opt = copy.deepcopy((model, opt))  # one deepcopy: the optimizer keeps the copied parameters
    torch.set_rng_state(rng)
    return str(path), model, opt
