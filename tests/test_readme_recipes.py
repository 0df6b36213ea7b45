"""The README's nanoGPT recipe, run as written: its shell lines through the installed command (in a fresh
process, in a folder holding nanoGPT's ``out/ckpt.pt``), its Python lines inside an emulation of the
nanoGPT code they replace (tools/make_checkpoint.py's GPT, optimizer groups and batches)."""

import importlib.util
import os
import pathlib
import re
import shlex
import subprocess
import sys

import torch

import ckptq
from ckptq.optim import AdamW8bit

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _tool(name):
    spec = importlib.util.spec_from_file_location(f"_ckptq_tool_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def recipe_blocks(name):
    """The fenced code blocks between ``<!-- recipe: name -->`` and ``<!-- /recipe -->`` in README.md:
    [(language, code)]."""
    text = (ROOT / "README.md").read_text()
    body = text.split(f"<!-- recipe: {name} -->", 1)[1].split("<!-- /recipe -->", 1)[0]
    return re.findall(r"```(\w+)\n(.*?)```", body, re.S)


def run_shell(code, cwd):
    """Each command line as the shell would run it (comments stripped), `ckptq` being this package's CLI."""
    for line in code.splitlines():
        argv = shlex.split(line, comments=True)
        if argv:
            assert argv[0] == "ckptq", line
            r = subprocess.run([sys.executable, "-m", "ckptq", *argv[1:]], cwd=cwd, capture_output=True, text=True)
            assert r.returncode == 0, f"{line}: {r.stderr}"


def test_nanogpt_recipe_runs_as_written(tmp_path):
    mk = _tool("make_checkpoint")
    blocks = recipe_blocks("nanogpt")
    assert [lang for lang, _ in blocks] == ["bash", "python", "python", "python", "bash"]
    (convert, model_py, resume, saving, expand) = (code for _, code in blocks)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    torch.save(mk.train(steps=3), out_dir / "ckpt.pt")  # nanoGPT's out/ckpt.pt

    run_shell(convert, tmp_path)
    assert os.listdir(out_dir) == ["ckpt.q8.safetensors"]  # no stale fp32 ckpt.pt beside it

    scope = {"os": os, "ckptq": ckptq, "out_dir": str(out_dir)}
    exec(resume, scope)  # train.py, init_from == 'resume'
    checkpoint = scope["checkpoint"]
    model = mk.GPT(**checkpoint["model_args"])
    model.load_state_dict(checkpoint["model"])
    groups = [g for g in mk.make_optimizer(model).param_groups]  # nanoGPT's two groups (decay / no decay)
    scope_model = {"AdamW8bit": AdamW8bit, "learning_rate": mk.LEARNING_RATE, "betas": mk.BETAS, "extra_args": {},
                   "optim_groups": [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups]}
    exec(model_py, scope_model)  # model.py, configure_optimizers()
    optimizer = scope_model["optimizer"]
    optimizer.load_state_dict(checkpoint["optimizer"])
    gen = torch.Generator().manual_seed(1)
    perm = torch.randperm(checkpoint["model_args"]["vocab_size"], generator=gen)
    for _ in range(3):  # training goes on in 8 bits
        x, y = mk.make_batch(checkpoint["model_args"]["vocab_size"], 4, checkpoint["model_args"]["block_size"], perm, gen)
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    scope["checkpoint"] = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                           "model_args": checkpoint["model_args"], "iter_num": checkpoint["iter_num"] + 3,
                           "best_val_loss": checkpoint["best_val_loss"], "config": checkpoint["config"]}
    exec(saving, scope)  # train.py, saving

    run_shell(expand, tmp_path)
    assert os.listdir(out_dir) == ["ckpt.pt"]
    back = torch.load(out_dir / "ckpt.pt", weights_only=True)  # what sample.py and a stock resume read
    assert back["iter_num"] == 6  # the 8-bit run's checkpoint, not the stale one
    for name, w in model.state_dict().items():
        assert torch.equal(back["model"][name], w), name
    fp32 = mk.make_optimizer(mk.GPT(**back["model_args"]))
    fp32.load_state_dict(back["optimizer"])  # torch.optim.AdamW takes the expanded state
    assert all(s["exp_avg"].dtype == torch.float32 for s in fp32.state.values())
