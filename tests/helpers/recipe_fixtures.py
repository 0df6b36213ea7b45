"""What each recipe of README.md and docs/ runs in (``FIXTURES``: a builder per recipe that fills a fresh
folder), the names its Python lines take from the code around them (``scope_for``), and what it must have
done beyond each command's exit status (``CHECKS``); tests/project/test_readme_recipes.py runs them."""

import atexit
import functools
import json
import os
import pathlib
import shutil
import tempfile

import torch

import ckptq
from ckptq.codec import signpost
from tests.helpers.models import TinyLM, param_groups, train
from tests.helpers.paths import ROOT
from tests.helpers.tools import load_tool
from tests.sources.test_folders import trained_optimizer, trainer_folder


def _tool(name):
    return load_tool("scripts", name)


# --- fixtures: what each recipe's folder holds -------------------------------------------------------

@functools.cache
def _built(build) -> pathlib.Path:
    """A fixture built once per session (in a folder removed at exit); recipes get copies."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="ckptq-recipes-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    build(folder)
    return folder


def _copy_of(build):
    def fixture(d):
        shutil.copytree(_built(build), d, dirs_exist_ok=True)
    fixture.__doc__ = build.__doc__
    return fixture


def _ckpt_file(d):
    """nanoGPT's ckpt.pt (tools/scripts/make_checkpoint.py's GPT after 3 AdamW steps)."""
    torch.save(_tool("make_checkpoint").train(steps=3), d / "ckpt.pt")


ckpt_file = _copy_of(_ckpt_file)


def run_folder(d):
    """A stock Trainer's output folder: out/checkpoint-{500,1000,1500}/ with fp32 optimizer.pt files."""
    for step in (500, 1000, 1500):
        trainer_folder(d / "out", step)


def ckptq_trainer_folder(d):
    """out/checkpoint-500/ as CkptqTrainer writes it: optimizer.q8.safetensors and the optimizer.pt signpost."""
    from ckptq.codec import signpost
    from ckptq.integrations import _state

    folder = trainer_folder(d / "out", 500)
    state, count = _state.stored_low_bit(torch.load(folder / "optimizer.pt", weights_only=True))
    assert count
    ckptq.save(state, str(folder / "optimizer.q8.safetensors"))
    torch.save(signpost.make(state, "ckptq: the optimizer state of checkpoint-500 is in optimizer.q8.safetensors"),
               folder / "optimizer.pt")


def accelerate_folder(d):
    """ckpt/ as accelerate's save_state writes it after low_bit_checkpoints: optimizer.bin holding 8-bit moments."""
    from ckptq.integrations.accelerate import low_bit_checkpoints

    torch.manual_seed(0)
    model = TinyLM()
    opt = low_bit_checkpoints(torch.optim.AdamW(param_groups(model), lr=1e-2))
    train(model, opt, 3)
    folder = d / "ckpt"
    folder.mkdir()
    torch.save(opt.state_dict(), folder / "optimizer.bin")
    torch.save({}, folder / "scheduler.bin")
    torch.save({"step": 3}, folder / "random_states_0.pkl")
    torch.save(model.state_dict(), folder / "pytorch_model.bin")


def lightning_ckpt(d):
    """run.ckpt as CkptqCheckpointIO saves it (ckptq/integrations/lightning.py, without importing Lightning):
    the states stored 8-bit under ckptq_optimizer_states, signposts in optimizer_states."""
    from ckptq.codec import signpost
    from ckptq.integrations import _state

    model, opt = trained_optimizer()
    state, count = _state.stored_low_bit(opt.state_dict())
    assert count
    torch.save({"epoch": 0, "global_step": 3, "state_dict": model.state_dict(), "lr_schedulers": [], "loops": {},
                "callbacks": {}, "optimizer_states": [signpost.make(state, "ckptq: stored under ckptq_optimizer_states")],
                signpost.LIGHTNING_STATES: [state], signpost.LIGHTNING_TORCHAO: []}, d / "run.ckpt")


def _dcp_state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optimizer": osd}


def _dcp_folder(d):
    """ckpt/step-1000: a dcp.save of {"model", "optimizer"} (torch AdamW) in one process."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_dcp_state(*trained_optimizer()), checkpoint_id=str(d / "ckpt" / "step-1000"), no_dist=True)


dcp_folder = _copy_of(_dcp_folder)


def deepspeed_run(d):
    """out/run: DeepSpeed's ZeRO-2 save dir of tests/fixtures/zero/, its step renamed global_step1000 and each
    rank's flat partitions repeated 5 times (4,820 elements, so that the default --min-size applies as it
    does to a real model's partitions), written back with DeepSpeed's objects as they were."""
    from ckptq.deepspeed import objects
    from ckptq.format import torch_stream

    src = ROOT / "tests" / "fixtures" / "zero" / "zero2" / "global_step3"
    dst = d / "out" / "run" / "global_step1000"
    dst.mkdir(parents=True)
    (d / "out" / "run" / "latest").write_text("global_step1000")
    for p in src.iterdir():
        if "optim_states" not in p.name:
            shutil.copy(p, dst / p.name)
            continue
        obj = objects.load(str(p))
        osd = obj["optimizer_state_dict"]
        for st in osd["base_optimizer_state"]["state"].values():
            st["exp_avg"], st["exp_avg_sq"] = st["exp_avg"].repeat(5), st["exp_avg_sq"].repeat(5)
        osd["single_partition_of_fp32_groups"] = [t.repeat(5) for t in osd["single_partition_of_fp32_groups"]]
        torch_stream.save(obj, str(dst / p.name), pickler=objects.Pickler)


def llama_config(d):
    """llama3-8b/config.json: Meta-Llama-3-8B's config as published (the fields ckptq estimate reads)."""
    (d / "llama3-8b").mkdir()
    (d / "llama3-8b" / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 128256, "max_position_embeddings": 8192, "hidden_act": "silu", "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "torch_dtype": "bfloat16"}))


def nothing(d):
    pass


FIXTURES = {
    "cli": ckpt_file, "python-api": ckpt_file, "replace": ckpt_file, "info": ckpt_file, "python-report": ckpt_file,
    "run-folder": run_folder, "all": run_folder,
    "trainer": ckptq_trainer_folder, "trainer-back": ckptq_trainer_folder,
    "accelerate": accelerate_folder, "accelerate-back": accelerate_folder,
    "lightning": lightning_ckpt, "lightning-back": lightning_ckpt,
    "dcp-folder": dcp_folder, "dcp-folders": dcp_folder, "dcp-torchrun": dcp_folder, "safe-dcp-load": dcp_folder,
    "deepspeed": deepspeed_run, "deepspeed-full": deepspeed_run,
    "estimate": llama_config, "estimate-python": llama_config, "install": nothing, "fresh-machine": nothing,
    "dcp-planners": nothing, "optimizer": nothing, "format-decoder": nothing,
    "trainer-mixin": nothing, "accelerate-store": nothing, "lightning-plugin": nothing, "fsdp2": nothing,
    "fabric": nothing, "cuda-graph": nothing, "muon": nothing,
}


def scope_for(name) -> dict:
    """The names a recipe's Python lines take from the code around them."""
    if name == "dcp-planners":
        model, opt = trained_optimizer()
        return {"model": model, "opt": opt}
    if name == "safe-dcp-load":
        return {"state_dict": _dcp_state(*trained_optimizer(1, seed=1)), "path": "ckpt/step-1000"}
    return {}


# --- what a recipe must have done, beyond each command's exit status ---------------------------------

def _is_fp32_adam(path):
    sd = torch.load(path, weights_only=True)
    return all(isinstance(s["exp_avg"], torch.Tensor) and s["exp_avg"].dtype == torch.float32 for s in sd["state"].values())


def _check_run_folder(d, scope):
    out = d / "out"
    for step in (500, 1000):
        assert sorted(os.listdir(out / f"checkpoint-{step}"))[:3] == ["model.pt", "optimizer.pt", "optimizer.q8.safetensors"]
        assert signpost.is_signpost_file(str(out / f"checkpoint-{step}" / "optimizer.pt"))  # stops a stock Trainer
    assert _is_fp32_adam(out / "checkpoint-1500" / "optimizer.pt")  # the newest, left for resuming


def _check_trainer_back(d, scope):
    folder = d / "out" / "checkpoint-500"
    assert not (folder / "optimizer.q8.safetensors").exists() and _is_fp32_adam(folder / "optimizer.pt")


def _check_format_decoder(d, scope):
    """docs/FORMAT.md's decoder gives ckptq's values on every golden file (all versions, widths, layouts)."""
    import numpy as np
    from safetensors import safe_open

    def walk(node, obj, f, n):
        if isinstance(node, dict) and ("dict" in node or "odict" in node):
            items = node.get("dict", node.get("odict"))
            siblings = {k: v for k, v in items if not isinstance(k, dict)}
            for k, v in items:
                if isinstance(v, dict) and "quantized" in v:
                    assert np.array_equal(scope["decode"](f, v, siblings), obj[k].numpy()), k
                    n += 1
                elif not isinstance(k, dict):
                    n = walk(v, obj[k], f, n)
        elif isinstance(node, dict) and ("list" in node or "tuple" in node):
            for v, o in zip(node.get("list", node.get("tuple")), obj):
                n = walk(v, o, f, n)
        return n

    golden = sorted((ROOT / "tests" / "golden").glob("*.safetensors"))
    assert len(golden) >= 5
    for path in golden:
        with safe_open(str(path), "np") as f:
            skeleton = json.loads(f.metadata()["ckptq.skeleton"])
            assert walk(skeleton, ckptq.load(str(path), dequantize=True), f, 0) >= 4, path.name


CHECKS = {"run-folder": _check_run_folder, "trainer-back": _check_trainer_back, "format-decoder": _check_format_decoder}
