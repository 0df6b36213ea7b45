"""ckptq.integrations.transformers with the real Trainer: a 2-layer GPT-2 built from its config (no
download) trains 8 steps with checkpoints every 4; a new trainer resumes from checkpoint-4 and must
continue as the uninterrupted run did (same steps, same learning rates, same optimizer class; the same
losses where the state is stored exactly: ckptq's AdamW8bit, torchao's 8-bit and 4-bit, bitsandbytes';
within 8-bit storage's error with torch's AdamW). A stock Trainer given a checkpoint whose state ckptq
stored 8-bit stops with ckptq's message, and resumes after ``ckptq expand``. ~6 s of CPU per run.

torchao's optimizers step through ``torch.compile``; here it runs eagerly (``eager_torchao``): the same
states and arithmetic, without minutes of C++ compilation per parameter shape on a shared CPU."""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import ckptq  # noqa: E402
from ckptq.codec.quant import dequantize_state  # noqa: E402
from ckptq.codec import signpost  # noqa: E402
from ckptq.errors import UsageError  # noqa: E402
from ckptq.integrations.transformers import OPTIMIZER_4BIT_NAME, OPTIMIZER_8BIT_NAME, CkptqTrainer  # noqa: E402
from ckptq.integrations.transformers import CkptqTrainerMixin  # noqa: E402
from ckptq.optim import AdamW8bit  # noqa: E402
from tests.helpers.integration_optimizers import qstate_widths  # noqa: E402

VOCAB, SEQ, STEPS, SAVE = 256, 32, 8, 4
# Trainer's optim names; "AdamW8bit" is ckptq's, passed as optimizer_cls_and_kwargs
OPTIM = {"torch AdamW": "adamw_torch", "torchao 8-bit": "adamw_torch_8bit", "torchao 4-bit": "adamw_torch_4bit",
         "bitsandbytes 8-bit": "adamw_bnb_8bit", "AdamW8bit": "adamw_torch"}
CONVERTED = ("torch AdamW", "torchao 8-bit", "torchao 4-bit")  # stored by ckptq in optimizer.q8.safetensors


class Tokens(torch.utils.data.Dataset):
    """Sequences where token t+1 = (token t + a) mod 256: learnable within a few steps."""

    def __init__(self, count: int = 256):
        g = torch.Generator().manual_seed(0)
        start, step = torch.randint(0, VOCAB, (count, 1), generator=g), torch.randint(1, 8, (count, 1), generator=g)
        self.ids = (start + step * torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_trainer(out: str, optimizer: str, trainer=CkptqTrainer, **kwargs) -> transformers.Trainer:
    if "bitsandbytes" in optimizer:
        pytest.importorskip("bitsandbytes")
    if "torchao" in optimizer:
        pytest.importorskip("torchao.optim")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=STEPS, save_steps=SAVE, logging_steps=1, per_device_train_batch_size=8,
        learning_rate=3e-3, warmup_steps=2, weight_decay=0.1, lr_scheduler_type="linear", report_to="none",
        use_cpu=True, seed=0, disable_tqdm=True, optim=OPTIM[optimizer])
    # Trainer's own AdamW arguments (lr, betas, eps, fused) and param groups, with ckptq's 8-bit class
    adamw_args = transformers.Trainer.get_optimizer_cls_and_kwargs(args)[1]
    custom = (AdamW8bit, adamw_args) if optimizer == "AdamW8bit" else None
    return trainer(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=Tokens(),
                   optimizer_cls_and_kwargs=custom, **kwargs)


def logged(trainer, after: int = 0) -> dict[int, tuple[float, float]]:
    """step -> (loss, learning rate) for steps > ``after`` (a resumed log starts with the checkpoint's)."""
    return {h["step"]: (h["loss"], h["learning_rate"]) for h in trainer.state.log_history
            if "loss" in h and h["step"] > after}


def check_continues(first, resumed, exact: bool, rel: float = 1e-4) -> None:
    """``resumed`` ran steps SAVE+1..STEPS with ``first``'s learning rates and losses: equal when ``exact``;
    else within ``rel``, low-bit storage's error of fp32 moments (8-bit: measured gaps <= 6e-7 relative, while
    a resume whose moments were lost (zeroed) is 2e-4 apart at step 6 and 4.5e-3 at step 7)."""
    assert resumed.state.global_step == STEPS
    before, after = logged(first), logged(resumed, SAVE)
    assert sorted(after) == list(range(SAVE + 1, STEPS + 1))
    for step, (loss, lr) in after.items():
        assert lr == pytest.approx(before[step][1], rel=1e-9)  # the scheduler resumed at step SAVE
        assert loss == before[step][0] if exact else loss == pytest.approx(before[step][0], rel=rel)


def torchao_states(trainer) -> set[str]:
    """The classes of the optimizer's Adam moments (torchao keeps small parameters' moments in fp32)."""
    state = trainer.optimizer.optimizer.state
    return {type(s[k]).__name__ for s in state.values() for k in ("exp_avg", "exp_avg_sq")}


@pytest.mark.parametrize("optimizer", list(OPTIM))
def test_trainer_checkpoints_resume_with_the_same_optimizer(tmp_path, optimizer, eager_torchao):
    first = make_trainer(str(tmp_path / "a"), optimizer)
    first.train()
    ckpt = tmp_path / "a" / f"checkpoint-{SAVE}"
    stored = ckpt / OPTIMIZER_8BIT_NAME
    cls = type(first.optimizer.optimizer)
    if optimizer in CONVERTED:
        assert stored.is_file() and signpost.is_signpost_file(str(ckpt / "optimizer.pt"))
        expanded = torch.load(ckptq.expand(str(stored), str(tmp_path / "fp32.pt")).output, weights_only=True)
        assert expanded["state"][0]["exp_avg"].dtype == torch.float32  # fp32 state, readable without torchao
    else:  # AdamW8bit's and bitsandbytes' state is stored as they keep it: Trainer's own file
        assert not stored.exists() and not signpost.is_signpost_file(str(ckpt / "optimizer.pt"))

    resumed = make_trainer(str(tmp_path / "b"), optimizer)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert type(resumed.optimizer.optimizer) is cls
    check_continues(first, resumed, exact=optimizer != "torch AdamW")
    if optimizer.startswith("torchao"):  # torchao's own quantized states again, not fp32 tensors
        assert torchao_states(resumed) == torchao_states(first) == {"Tensor", f"OptimState{optimizer[-5:-4]}bit"}
    if optimizer not in CONVERTED:  # and a stock Trainer resumes these checkpoints as well
        stock = make_trainer(str(tmp_path / "c"), optimizer, trainer=transformers.Trainer)
        stock.train(resume_from_checkpoint=str(ckpt))
        check_continues(first, stock, exact=True)


def test_torchao_state_is_stored_with_its_own_codes(tmp_path, eager_torchao):
    trainer = make_trainer(str(tmp_path / "a"), "torchao 4-bit")
    trainer.train()
    live = trainer.optimizer.optimizer.state_dict()["state"][0]  # wte, 256 x 64: OptimState4bit
    stored = ckptq.load(str(tmp_path / "a" / f"checkpoint-{STEPS}" / OPTIMIZER_8BIT_NAME))["state"][0]
    for key in ("exp_avg", "exp_avg_sq"):
        assert stored[key]["bits"] == 4 and torch.equal(stored[key]["absmax"], live[key].scale)
        assert torch.equal(dequantize_state(stored[key]), live[key].dequantize())


def test_stock_trainer_stops_at_a_ckptq_checkpoint_and_resumes_after_expand(tmp_path):
    first = make_trainer(str(tmp_path / "a"), "torch AdamW")
    first.train()
    ckpt = tmp_path / "a" / f"checkpoint-{SAVE}"
    stock = make_trainer(str(tmp_path / "b"), "torch AdamW", trainer=transformers.Trainer)
    with pytest.raises(ValueError, match=r"could not convert string to float: b'ckptq: the optimizer state of "
                                         r"checkpoint-4 is in optimizer\.q8\.safetensors.*CkptqTrainer.*"
                                         r"`ckptq expand checkpoint-4`"):
        stock.train(resume_from_checkpoint=str(ckpt))
    assert logged(stock, SAVE) == {}  # stopped while loading, before any step

    # `ckptq expand checkpoint-4 --replace`: an fp32 optimizer.pt over the signpost (no --force: ckptq wrote
    # it), no 8-bit file
    ckptq.expand(str(ckpt), replace=True)
    assert not (ckpt / OPTIMIZER_8BIT_NAME).exists()
    stock = make_trainer(str(tmp_path / "c"), "torch AdamW", trainer=transformers.Trainer)
    stock.train(resume_from_checkpoint=str(ckpt))
    check_continues(first, stock, exact=False)
    # and a stock Trainer's checkpoint resumes under CkptqTrainer, whose next ones are 8-bit again
    switched = make_trainer(str(tmp_path / "d"), "torch AdamW")
    switched.train(resume_from_checkpoint=str(ckpt))
    check_continues(first, switched, exact=False)
    assert (tmp_path / "d" / f"checkpoint-{STEPS}" / OPTIMIZER_8BIT_NAME).is_file()


def test_ckptq_info_and_expand_read_a_ckptq_trainer_folder(tmp_path):
    make_trainer(str(tmp_path / "a"), "torch AdamW").train()
    ckpt = tmp_path / "a" / f"checkpoint-{SAVE}"
    parts = ckptq.info(str(ckpt)).parts  # the 8-bit file; the signpost is no optimizer state
    assert [os.path.basename(p.path) for p in parts] == [OPTIMIZER_8BIT_NAME] and parts[0].low_bit() > 0
    ckptq.expand(str(ckpt))  # `ckptq expand checkpoint-4`: the fp32 optimizer.pt replaces the signpost
    assert torch.load(ckpt / "optimizer.pt", weights_only=True)["state"][0]["exp_avg"].dtype == torch.float32


def test_a_converted_bitsandbytes_run_resumes_in_bitsandbytes_own_form(tmp_path):
    """A stock Trainer run with optim="adamw_bnb_8bit", its checkpoint converted with --replace: CkptqTrainer
    hands bitsandbytes its own state1/state2 form again (torch's form made its first step raise
    KeyError: 'state1'), within 8-bit storage's error (measured <= 4e-6 relative); a stock Trainer stops at the
    signpost before its first step."""
    first = make_trainer(str(tmp_path / "a"), "bitsandbytes 8-bit", trainer=transformers.Trainer)
    first.train()
    ckpt = tmp_path / "a" / f"checkpoint-{SAVE}"
    assert ckptq.convert(str(ckpt), replace=True).signposts == [str(ckpt / "optimizer.pt")]
    resumed = make_trainer(str(tmp_path / "b"), "bitsandbytes 8-bit")
    resumed.train(resume_from_checkpoint=str(ckpt))
    check_continues(first, resumed, exact=False)
    live = resumed.optimizer.optimizer.state[resumed.model.transformer.h[0].attn.c_attn.weight]  # 64 x 192
    assert live["state1"].dtype == torch.uint8 and live["absmax1"].numel() == live["state1"].numel() // 256
    embedding = resumed.optimizer.optimizer.state[resumed.model.transformer.wte.weight]
    assert embedding["state1"].dtype == torch.float32  # Trainer keeps bitsandbytes' embeddings 32-bit
    stock = make_trainer(str(tmp_path / "c"), "bitsandbytes 8-bit", trainer=transformers.Trainer)
    with pytest.raises(TypeError, match="can't concat int to bytes"):  # bitsandbytes' step reads the signpost's step
        stock.train(resume_from_checkpoint=str(ckpt))
    assert logged(stock, SAVE) == {}


class MixedInTrainer(CkptqTrainerMixin, transformers.Trainer):
    """A Trainer subclass (as TRL's SFTTrainer is) that takes the mixin, and with it ``bits=``."""


def test_bits_4_checkpoints_hold_4bit_state_and_resume_at_either_width(tmp_path):
    """``bits=4`` (here through the mixin): ``optimizer.q4.safetensors`` (6-bit ratio over 2-bit second moment)
    and a signpost naming it; a trainer at the default 8 bits resumes it, within 4-bit storage's error (measured
    <= 5e-4 relative; moments lost: 4.5e-3 at step 7), and its own next checkpoints are 8-bit. A width other
    than 8 or 4 stops at once."""
    first = make_trainer(str(tmp_path / "a"), "torch AdamW", trainer=MixedInTrainer, bits=4)
    first.train()
    ckpt = tmp_path / "a" / f"checkpoint-{SAVE}"
    assert not (ckpt / OPTIMIZER_8BIT_NAME).exists()
    assert qstate_widths(ckptq.load(str(ckpt / OPTIMIZER_4BIT_NAME))) == {6, 2}
    message = torch.load(ckpt / "optimizer.pt", weights_only=True)[signpost.SIGNPOST_KEY]
    assert f"checkpoint-{SAVE} is in {OPTIMIZER_4BIT_NAME}" in message
    resumed = make_trainer(str(tmp_path / "b"), "torch AdamW")
    resumed.train(resume_from_checkpoint=str(ckpt))
    check_continues(first, resumed, exact=False, rel=1e-3)
    assert (tmp_path / "b" / f"checkpoint-{STEPS}" / OPTIMIZER_8BIT_NAME).is_file()
    with pytest.raises(UsageError, match="6-bit state is not supported; use bits=8 or bits=4"):
        make_trainer(str(tmp_path / "c"), "torch AdamW", bits=6)
