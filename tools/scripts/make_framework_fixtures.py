"""Make the small checkpoint folders of frameworks whose pins conflict with ckptq's test extras, with the real
libraries, under tests/fixtures/ (tests/sources/test_framework_fixtures.py reads them without those libraries):

    python3 -m venv /work/venv-fixtures                       # outside the repository
    /work/venv-fixtures/bin/pip install torch==2.13.0         # first: the CPU build, so nothing pulls CUDA's
    /work/venv-fixtures/bin/pip install ai2-olmo-core==3.0.0 litgpt==0.5.13
    /work/venv-fixtures/bin/python tools/scripts/make_framework_fixtures.py litgpt [--out tests/fixtures/litgpt]
    /work/venv-fixtures/bin/python tools/scripts/make_framework_fixtures.py litgpt-resume RUN   # the checks below
    /work/venv-fixtures/bin/python tools/scripts/make_framework_fixtures.py olmo-core [--out tests/fixtures/olmo_core]
    /work/venv-fixtures/bin/python tools/scripts/make_framework_fixtures.py olmo-core-resume RUN

``litgpt``: ``litgpt.pretrain.setup`` of a 1-layer GPT (n_embd 32, vocab 128) on 4 steps of random tokens,
one device, fp32, a checkpoint every 2 steps: ``out/step-00000002/lit_model.pth`` and ``step-00000004/``
(``{"model", "optimizer", "train_dataloader", "iter_num", "step_count"}`` saved by ``fabric.save``, with
litgpt's ``model_config.yaml`` and ``hyperparameters.yaml``); ``final/`` is left out. ``torch.compile`` is
replaced by the identity (litgpt compiles the model; on a CPU that takes minutes and changes no checkpoint).

``litgpt-resume RUN``: litgpt's own ``--resume`` of RUN (a copy): after ``ckptq convert RUN --all --replace``
it must stop with ckptq's message (the newest ``lit_model.pth`` is converted in place), and after ``ckptq
expand RUN/step-00000004 --replace`` it must resume at step 4 and train on. ckptq must be importable (``pip
install -e . --no-deps`` into this venv).

``olmo-core``: OLMo-core's own ``TransformerConfig.llama_like`` model (d_model 32, 1 layer, vocab 128), 3 steps
of torch AdamW, saved as OLMo-core's trainer checkpointer lays out ``run/step3/``: ``model_and_optim/`` by
``olmo_core.distributed.checkpoint.save_model_and_optim_state`` (DCP with flattened optimizer keys,
``optim.state.<fqn>.exp_avg``, and OLMo-core's own ``_StorageInfo`` in ``.metadata``), ``train/rank0.pt`` and
``.metadata.json``. ``olmo-core-resume RUN``: OLMo-core's ``load_model_and_optim_state`` of a copy after ``ckptq
convert RUN --all --replace`` must stop with ckptq's message, and after ``ckptq expand RUN/step3 --replace``
load the same moments (within 8-bit storage's error) and step on.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["litgpt", "litgpt-resume", "olmo-core", "olmo-core-resume"])
    ap.add_argument("path", nargs="?", default=None)
    return ap


if __name__ == "__main__":
    build_parser().parse_args()  # --help and usage errors answer here, before torch and ckptq load

import torch  # noqa: E402


class _Loader(torch.utils.data.DataLoader):
    """A DataLoader that Fabric saves as state (an empty dict) instead of pickling it whole."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _litgpt_data():
    from litgpt.data import DataModule

    class Tokens(DataModule):
        def connect(self, tokenizer=None, batch_size: int = 1, max_seq_length: int | None = None, **kw) -> None:
            self.batch_size, self.length = batch_size, (max_seq_length or 32) + 1

        def _loader(self, seed: int) -> _Loader:
            ids = torch.randint(0, 128, (64, self.length), generator=torch.Generator().manual_seed(seed))
            return _Loader(ids, batch_size=self.batch_size)

        def train_dataloader(self):
            return self._loader(0)

        def val_dataloader(self):
            return self._loader(1)

    return Tokens()


def _litgpt_pretrain(out: str, resume=False, max_steps: int = 4) -> None:
    from litgpt import Config
    from litgpt.args import EvalArgs, TrainArgs
    from litgpt.pretrain import setup

    torch.compile = lambda model, *a, **k: model  # eager: the same checkpoints, without minutes of compiling
    config = Config(name="tiny", block_size=32, vocab_size=128, padded_vocab_size=128, n_layer=1, n_head=2,
                    n_embd=32, intermediate_size=64, rotary_percentage=1.0, bias=False)
    train = TrainArgs(save_interval=2, log_interval=1, global_batch_size=2, micro_batch_size=2, max_tokens=max_steps * 2 * 32,
                      lr_warmup_steps=1, max_norm=1.0, min_lr=1e-4)
    setup(model_name="tiny", model_config=config, out_dir=out, precision="32-true", resume=resume,
          data=_litgpt_data(), train=train, eval=EvalArgs(interval=1000, max_iters=1, initial_validation=False,
                                                           final_validation=False),
          devices=1, logger_name="csv", seed=0)


def make_litgpt(out: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run = os.path.join(tmp, "out")
        _litgpt_pretrain(run)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.makedirs(out)
        for name in sorted(os.listdir(run)):
            if name.startswith("step-"):
                shutil.copytree(os.path.join(run, name), os.path.join(out, name))
    print(f"wrote {out}: {sorted(os.listdir(out))}")


def litgpt_resume(run: str) -> None:
    """litgpt's --resume after ckptq convert --replace (must stop with ckptq's message), then after expand."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, "out")
        shutil.copytree(run, copy)
        ckptq = [sys.executable, "-m", "ckptq"]
        subprocess.run([*ckptq, "convert", copy, "--all", "--replace"], check=True)
        try:
            _litgpt_pretrain(copy, resume=True, max_steps=6)
        except ValueError as e:
            print(f"stock litgpt --resume after convert --replace stopped: {str(e)[:160]}")
        else:
            raise SystemExit("litgpt resumed a converted checkpoint without ckptq: the signpost did not stop it")
        subprocess.run([*ckptq, "expand", os.path.join(copy, "step-00000004"), "--replace"], check=True)
        _litgpt_pretrain(copy, resume=True, max_steps=6)
        print(f"after expand, litgpt resumed and saved {sorted(n for n in os.listdir(copy) if n.startswith('step-'))}")
    # What `python -m ckptq.integrations.litgpt` does around litgpt's main, here around litgpt.pretrain.setup
    # (called directly for the data module and torch.compile above): litgpt's Fabric gets CkptqCheckpointIO
    # while litgpt runs, and its --resume reads the 8-bit state back.
    from ckptq.codec import signpost
    from ckptq.integrations.litgpt import litgpt_fabric

    with tempfile.TemporaryDirectory() as tmp, litgpt_fabric(8):
        eight = os.path.join(tmp, "out")
        _litgpt_pretrain(eight)
        full = torch.load(os.path.join(run, "step-00000004", "lit_model.pth"), weights_only=True)
        saved = os.path.join(eight, "step-00000004", "lit_model.pth")
        assert signpost.carries(torch.load(saved, weights_only=True)["optimizer"])
        print(f"through the ckptq.integrations.litgpt launcher: lit_model.pth {os.path.getsize(saved)} bytes (fp32 "
              f"optimizer: {sum(t.numel() * 4 for s in full['optimizer']['state'].values() for t in s.values())} "
              "bytes of state)")
        _litgpt_pretrain(eight, resume=True, max_steps=6)
        print(f"and litgpt --resume of it saved {sorted(n for n in os.listdir(eight) if n.startswith('step-'))}")


def _olmo_model():
    from olmo_core.nn.transformer import TransformerConfig

    torch.manual_seed(0)
    return TransformerConfig.llama_like(d_model=32, vocab_size=128, n_layers=1, n_heads=2).build(init_device="cpu")


def _olmo_dist() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def make_olmo_core(out: str, steps: int = 3) -> None:
    from olmo_core.distributed.checkpoint import save_model_and_optim_state
    from olmo_core.train.checkpoint import Checkpointer, CheckpointMetadata

    _olmo_dist()
    model = _olmo_model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(steps):
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(step))
        logits = model(ids)
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 128), ids[:, 1:].reshape(-1)).backward()
        optim.step()
        optim.zero_grad()
    if os.path.exists(out):
        shutil.rmtree(out)
    folder = os.path.join(out, f"step{steps}")
    save_model_and_optim_state(os.path.join(folder, "model_and_optim"), model, optim, flatten_optimizer_state=True,
                               thread_count=1)
    os.makedirs(os.path.join(folder, "train"))
    torch.save({"global_step": steps, "global_train_tokens_seen": steps * 32}, os.path.join(folder, "train", "rank0.pt"))
    Checkpointer(work_dir=out)._save_metadata(folder, CheckpointMetadata())
    print(f"wrote {out}: {sorted(os.listdir(folder))}")


def olmo_core_resume(run: str) -> None:
    from olmo_core.distributed.checkpoint import load_model_and_optim_state

    _olmo_dist()
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, "run")
        shutil.copytree(run, copy)
        ckptq = [sys.executable, "-m", "ckptq"]
        subprocess.run([*ckptq, "convert", copy, "--all", "--replace"], check=True)
        model = _olmo_model()
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        try:
            load_model_and_optim_state(os.path.join(copy, "step3", "model_and_optim"), model, optim,
                                       flatten_optimizer_state=True)
        except BaseException as e:  # DCP wraps what the reader raised
            assert "ckptq: model_and_optim went to model_and_optim.q8" in str(e), str(e)[-500:]
            print("OLMo-core's load after convert --replace stopped with ckptq's message")
        else:
            raise SystemExit("OLMo-core loaded a converted checkpoint without ckptq: the signpost did not stop it")
        subprocess.run([*ckptq, "expand", os.path.join(copy, "step3"), "--replace"], check=True)
        load_model_and_optim_state(os.path.join(copy, "step3", "model_and_optim"), model, optim,
                                   flatten_optimizer_state=True)
        steps = {float(s["step"]) for s in optim.state.values()}
        print(f"after expand, OLMo-core loaded the optimizer (steps {steps}); one more step:")
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(9))
        torch.nn.functional.cross_entropy(model(ids)[:, :-1].reshape(-1, 128), ids[:, 1:].reshape(-1)).backward()
        optim.step()
        print(f"  step {sorted({float(s['step']) for s in optim.state.values()})}")


def main() -> None:
    args = build_parser().parse_args()
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fixtures")
    if args.what == "litgpt":
        make_litgpt(args.path or os.path.join(here, "litgpt"))
    elif args.what == "litgpt-resume":
        litgpt_resume(args.path or os.path.join(here, "litgpt"))
    elif args.what == "olmo-core":
        make_olmo_core(args.path or os.path.join(here, "olmo_core"))
    else:
        olmo_core_resume(args.path or os.path.join(here, "olmo_core"))


if __name__ == "__main__":
    main()
