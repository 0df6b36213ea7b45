"""Hugging Face ``Trainer`` checkpoints with the optimizer state stored 8-bit (or 4-bit).

    from ckptq.integrations.transformers import CkptqTrainer
    trainer = CkptqTrainer(model=model, args=args, train_dataset=ds)   # Trainer's arguments; bits=4: 4-bit
    trainer.train(resume_from_checkpoint=True)

With an optimizer that keeps fp32 Adam moments (torch's AdamW, Trainer's default), each ``checkpoint-N``
holds ``optimizer.q8.safetensors`` (ckptq's format, ~2 bytes per parameter instead of 8; with ``bits=4``
``optimizer.q4.safetensors``, ~1) and resuming reads either back, decoded to fp32 (low-bit storage is lossy,
the optimizer stays fp32). With torchao's
``AdamW8bit``/``AdamW4bit`` (``optim="adamw_torch_8bit"``/``"adamw_torch_4bit"``) the file holds
torchao's own codes, scales and codebooks as ckptq qstates, and resuming rebuilds the very same states:
training continues exactly (``ckptq.integrations._state`` says why this form). With an optimizer whose
state ckptq stores as it is (ckptq's ``AdamW8bit``, bitsandbytes', SGD) the folder holds Trainer's own
``optimizer.pt``, which a stock Trainer resumes too. A checkpoint that has only ``optimizer.pt`` (a
stock Trainer's) resumes as Trainer resumes it. For a Trainer subclass (TRL's ``SFTTrainer``...):
``class T(CkptqTrainerMixin, SFTTrainer)``.

Beside ``optimizer.q8.safetensors`` lies an ``optimizer.pt`` signpost (``ckptq.codec.signpost``):
a stock Trainer that resumes the folder loads it and stops (torch's AdamW: ``ValueError: could not
convert string to float: b'ckptq: ...'``, naming the two ways on) instead of starting a fresh optimizer
and scheduler without a word, which is what it does when ``optimizer.pt`` is missing. The way back to a
stock Trainer: ``ckptq expand checkpoint-N`` writes the fp32 ``optimizer.pt`` over the signpost
(``--replace`` also deletes ``optimizer.q8.safetensors``).

Why a Trainer subclass and not a ``TrainerCallback``: Trainer loads ``optimizer.pt`` in
``_load_optimizer_and_scheduler`` before any callback event of the resumed run, and no callback learns
the folder it resumes from; this mixin overrides that method and ``_save_optimizer_and_scheduler``
(both present, with these signatures, since transformers 4.x). Under DeepSpeed, FSDP, XLA or SageMaker
model parallelism, which write their own optimizer files, Trainer's own saving and loading run unchanged.
"""

from __future__ import annotations

import os

import torch

from ._requires import framework_missing

try:
    from transformers import Trainer
    from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME
    from transformers.utils import is_sagemaker_mp_enabled, is_torch_xla_available
except ImportError as e:
    raise framework_missing("ckptq.integrations.transformers", "transformers", "transformers", e) from e

from ..sources import single as api  # save and load: not the detection of every layout
from ..codec import signpost
from . import _state

OPTIMIZER_8BIT_NAME = "optimizer.q8.safetensors"
OPTIMIZER_4BIT_NAME = "optimizer.q4.safetensors"
STORED_NAMES = {8: OPTIMIZER_8BIT_NAME, 4: OPTIMIZER_4BIT_NAME}  # by bits; resuming reads the first found


class CkptqTrainerMixin:
    """Put before ``Trainer`` (or a subclass of it) in the bases: checkpoints store the optimizer's Adam
    moments at ``bits`` bits per value (8 or 4, as ``ckptq convert --bits``), a keyword the subclass takes
    besides its own (``MyTrainer(..., bits=4)``). Resuming reads a folder of either width. UsageError for
    ``bits`` other than 8 or 4."""

    def __init__(self, *args, bits: int = 8, **kwargs):
        self._ckptq_options = _state.options(bits)  # checked before Trainer builds anything
        super().__init__(*args, **kwargs)

    def _ckptq_applies(self) -> bool:
        """The plain single-process / DDP path, where Trainer itself torch.saves ``optimizer.state_dict()``."""
        return not (self.is_deepspeed_enabled or self.is_fsdp_enabled or is_torch_xla_available()
                    or is_sagemaker_mp_enabled())

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._ckptq_applies():
            return super()._save_optimizer_and_scheduler(output_dir)
        if not self.args.should_save:  # DDP: the main process writes, as Trainer does
            return
        options = getattr(self, "_ckptq_options", None) or _state.options()
        state, count = _state.stored_low_bit(self.optimizer.state_dict(), **options)
        name = STORED_NAMES[options["bits"]]
        stored, plain = os.path.join(output_dir, name), os.path.join(output_dir, OPTIMIZER_NAME)
        if count:
            api.save(state, stored, force=True)
            torch.save(signpost.make(state, _signpost_message(output_dir, name)), plain)
        else:  # stored as the optimizer keeps it: Trainer's own file, which a stock Trainer resumes
            torch.save(state, plain)
        for stale in (os.path.join(output_dir, n) for n in STORED_NAMES.values() if n != name or not count):
            if os.path.isfile(stale):  # a folder saved over keeps no stale low-bit copy, which resuming would prefer
                os.remove(stale)
        torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        names = STORED_NAMES.values()  # what CkptqTrainer or `ckptq convert [--bits 4]` wrote
        path = next((p for n in names if checkpoint and os.path.isfile(p := os.path.join(checkpoint, n))), None)
        if not (path and self._ckptq_applies()):
            return super()._load_optimizer_and_scheduler(checkpoint)
        state = api.load(path)
        self.optimizer.load_state_dict(_state.for_optimizer(self.optimizer, state))
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))


def _signpost_message(output_dir: str, stored: str) -> str:
    return signpost.trainer_message(os.path.basename(os.path.normpath(output_dir)), stored)


class CkptqTrainer(CkptqTrainerMixin, Trainer):
    """``transformers.Trainer`` whose checkpoints hold the optimizer state 8-bit (``optimizer.q8.safetensors``),
    or 4-bit with ``bits=4`` (``optimizer.q4.safetensors``); its other arguments are Trainer's."""
