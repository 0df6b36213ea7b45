"""Lightning checkpoints with ``optimizer_states`` stored 8-bit inside the ``.ckpt``.

    from ckptq.integrations.lightning import CkptqCheckpointIO
    trainer = lightning.Trainer(..., plugins=[CkptqCheckpointIO()])
    trainer.fit(model, data, ckpt_path="last")           # resumes from the 8-bit state

Saving, each fp32 Adam moment of ``checkpoint["optimizer_states"]`` becomes ckptq's 8-bit state dict
(``ckptq convert``'s plan: codes, scales and codebook tensors beside PyTorch's state keys), which
``torch.save`` writes and ``torch.load(weights_only=True)`` reads; a ckptq ``AdamW8bit``'s state is 8-bit
already and is written as it is. The checkpoint records which optimizers were fp32
(``ckptq_fp32_optimizer_states``), and loading decodes exactly those back to fp32, so torch's AdamW
resumes with fp32 moments (8-bit storage is lossy) and ``AdamW8bit`` with its own state (exact).
``ckptq info run.ckpt`` describes such a file and ``ckptq expand run.ckpt -o run.fp32.ckpt`` turns it into
a checkpoint that Lightning's default ``TorchCheckpointIO`` resumes; that is also the way to move an
``AdamW8bit`` run's checkpoint to torch's AdamW.
"""

from __future__ import annotations

from typing import Any

try:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
except ImportError as e:
    raise ImportError(f"ckptq.integrations.lightning needs Lightning ({e}); pip install lightning") from e

from ..codec import policy, quant
from . import _state

FP32_KEY = "ckptq_fp32_optimizer_states"  # indices into optimizer_states: stored 8-bit from fp32, decoded on load


class CkptqCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` with the optimizer states' Adam moments stored 8-bit (states of at
    least ``min_size`` elements, blocks of ``block_size``)."""

    def __init__(self, block_size: int = 256, min_size: int = policy.DEFAULT_MIN_SIZE):
        super().__init__()
        self.block_size, self.min_size = block_size, min_size

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if checkpoint.get("optimizer_states"):  # a weights-only checkpoint has none
            stored, fp32 = [], []
            for i, state_dict in enumerate(checkpoint["optimizer_states"]):
                state_dict, count = _state.stored_8bit(state_dict, block_size=self.block_size, min_size=self.min_size)
                stored.append(state_dict)
                if count:
                    fp32.append(i)
            checkpoint = {**checkpoint, "optimizer_states": stored, FP32_KEY: fp32}
        super().save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(self, path, *args, **kwargs) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(path, *args, **kwargs)
        for i in checkpoint.pop(FP32_KEY, ()):
            quant.decode_qstates(checkpoint["optimizer_states"][i])
        return checkpoint
