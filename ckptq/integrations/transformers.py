"""Hugging Face ``Trainer`` checkpoints with the optimizer state stored 8-bit.

    from ckptq.integrations.transformers import CkptqTrainer
    trainer = CkptqTrainer(model=model, args=args, train_dataset=ds)   # Trainer's arguments, unchanged
    trainer.train(resume_from_checkpoint=True)

Each ``checkpoint-N`` then holds ``optimizer.q8.safetensors`` (ckptq's format, ~2 bytes per parameter)
and no ``optimizer.pt`` (8 bytes per parameter for torch's AdamW); resuming reads it back: into torch's
AdamW decoded to fp32 (8-bit storage is lossy, the optimizer stays fp32), into ckptq's ``AdamW8bit`` as
stored (exact). A checkpoint that has only ``optimizer.pt`` (a stock Trainer's) resumes as Trainer
resumes it. For a Trainer subclass (TRL's ``SFTTrainer``...): ``class T(CkptqTrainerMixin, SFTTrainer)``.

Why a Trainer subclass and not a ``TrainerCallback``: Trainer loads ``optimizer.pt`` in
``_load_optimizer_and_scheduler`` before any callback event of the resumed run, and no callback learns
the folder it resumes from; this mixin overrides that method and ``_save_optimizer_and_scheduler``
(both present, with these signatures, since transformers 4.x). Under DeepSpeed, FSDP, XLA or SageMaker
model parallelism, which write their own optimizer files, Trainer's own saving and loading run unchanged.
"""

from __future__ import annotations

import os

import torch

try:
    from transformers import Trainer
    from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME
    from transformers.utils import is_sagemaker_mp_enabled, is_torch_xla_available
except ImportError as e:
    raise ImportError(f"ckptq.integrations.transformers needs transformers ({e}); pip install transformers") from e

from ..sources import api
from . import _state

OPTIMIZER_8BIT_NAME = "optimizer.q8.safetensors"


class CkptqTrainerMixin:
    """Put before ``Trainer`` (or a subclass of it) in the bases: checkpoints store the optimizer 8-bit."""

    def _ckptq_applies(self) -> bool:
        """The plain single-process / DDP path, where Trainer itself torch.saves ``optimizer.state_dict()``."""
        return not (self.is_deepspeed_enabled or self.is_fsdp_enabled or is_torch_xla_available()
                    or is_sagemaker_mp_enabled())

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._ckptq_applies():
            return super()._save_optimizer_and_scheduler(output_dir)
        if not self.args.should_save:  # DDP: the main process writes, as Trainer does
            return
        state, _ = _state.stored_8bit(self.optimizer.state_dict())
        api.save(state, os.path.join(output_dir, OPTIMIZER_8BIT_NAME), force=True)
        stale = os.path.join(output_dir, OPTIMIZER_NAME)  # a folder saved over keeps no fp32 copy beside it
        if os.path.isfile(stale):
            os.remove(stale)
        torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        path = os.path.join(checkpoint, OPTIMIZER_8BIT_NAME) if checkpoint else None
        if not (path and os.path.isfile(path) and self._ckptq_applies()):
            return super()._load_optimizer_and_scheduler(checkpoint)
        state = api.load(path)
        self.optimizer.load_state_dict(_state.for_optimizer(self.optimizer, state))
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))


class CkptqTrainer(CkptqTrainerMixin, Trainer):
    """``transformers.Trainer`` whose checkpoints hold ``optimizer.q8.safetensors`` instead of ``optimizer.pt``."""
