"""Lightning and Fabric checkpoints with the optimizer states stored 8-bit inside the ``.ckpt``.

    from ckptq.integrations.lightning import CkptqCheckpointIO
    trainer = lightning.Trainer(..., plugins=[CkptqCheckpointIO()])
    trainer.fit(model, data, ckpt_path="last")           # resumes from the 8-bit state
    fabric = lightning.Fabric(..., plugins=[CkptqCheckpointIO()])   # Fabric (and so litgpt): the same plugin
    fabric.save(path, {"model": model, "optimizer": optimizer})     # fabric.load(path, state) resumes

Fabric saves each optimizer's state under a key of its own (``"optimizer"``), not in ``optimizer_states``:
each such top-level state dict is stored as a signpost carrying its 8-bit state (``ckptq.codec.signpost``),
which stock Fabric stops at (``ValueError: could not convert string to float: b'ckptq: ...'``) and this
plugin puts back. Files that ``ckptq convert FILE --replace`` converted in place hold the same signposts,
and this plugin resumes them too.

Saving, each fp32 Adam moment of an optimizer state becomes ckptq's 8-bit state dict (``ckptq
convert``'s plan: codes, scales and codebook tensors beside PyTorch's state keys), and each state of
torchao's ``AdamW8bit``/``AdamW4bit`` a qstate holding its very codes (``ckptq.integrations._state``
says why); ``torch.save`` writes them and ``torch.load(weights_only=True)`` reads them, without torchao.
Such an optimizer's state goes under ``ckptq_optimizer_states`` and a signpost takes its place in
``optimizer_states`` (``ckptq.codec.signpost``); loading puts it back: torch's AdamW resumes with
fp32 moments (8-bit storage is lossy), torchao's optimizers with their own states, bit for bit. An
optimizer whose state ckptq keeps as it is (ckptq's ``AdamW8bit``, whose state is 8-bit already; SGD)
stays in ``optimizer_states`` unchanged, and stock Lightning resumes it as well.

Stock Lightning (``TorchCheckpointIO``) given such a ``.ckpt`` stops while restoring, before it prints
"Restored all states" (torch's AdamW: ``ValueError: could not convert string to float: b'ckptq: ...'``,
naming the two ways on; torchao's optimizers at their first step), where it used to load the 8-bit dicts
and fail at the first step with ``'dict' object has no attribute 'lerp_'``. The way back to stock
Lightning, and to another optimizer class: ``ckptq expand run.ckpt -o run.fp32.ckpt``, which puts the
states back under ``optimizer_states``, fp32 (``signpost.unwrap``). ``ckptq info run.ckpt`` describes
the file.
"""

from __future__ import annotations

import os
from typing import Any

from ._requires import framework_missing

try:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
except ImportError as e:
    raise framework_missing("ckptq.integrations.lightning", "Lightning", "lightning", e) from e

from ..codec import foreign, policy, quant, signpost
from ..codec.checkpoint import is_optimizer_state, iter_tensors
from . import _state

# Files of ckptq 0.1 kept the 8-bit states in optimizer_states and listed here those to decode on load.
FP32_KEY = "ckptq_fp32_optimizer_states"
TORCHAO_FLAG = "ckptq_torchao"  # in a Fabric signpost: the state it carries is torchao's, kept exact


class CkptqCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` with the optimizer states' Adam moments stored 8-bit (states of at
    least ``min_size`` elements, blocks of ``block_size``)."""

    def __init__(self, block_size: int = 256, min_size: int = policy.DEFAULT_MIN_SIZE):
        super().__init__()
        self.block_size, self.min_size = block_size, min_size

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        name = os.path.basename(str(path))
        if checkpoint.get("optimizer_states"):  # Lightning's Trainer (a weights-only checkpoint has none)
            checkpoint = {**checkpoint, **self._stored(checkpoint["optimizer_states"], name)}
        checkpoint = {**checkpoint, **self._fabric_stored(checkpoint, name)}
        super().save_checkpoint(checkpoint, path, storage_options)

    def _fabric_stored(self, checkpoint: dict, name: str) -> dict:
        """Fabric's ``fabric.save(path, {"model": ..., "optimizer": ...})``: each optimizer state dict at the
        top level (under any key) as a signpost carrying its 8-bit state, torchao's flagged for the load."""
        out = {}
        for key, value in checkpoint.items():
            if key == "optimizer_states" or not is_optimizer_state(value) or signpost.is_signpost(value):
                continue
            copy, count = _state.stored_8bit(value, block_size=self.block_size, min_size=self.min_size)
            if count:
                out[key] = signpost.make(copy, signpost.fabric_message(key, name), copy)
                out[key][TORCHAO_FLAG] = any(foreign.is_torchao(t) for t in iter_tensors(value["state"]))
        return out

    def _stored(self, states: list, name: str) -> dict:
        """``optimizer_states`` with a signpost for each state stored in another form, and those states."""
        shown, stored, torchao = [], [], []
        for i, state_dict in enumerate(states):
            copy, count = _state.stored_8bit(state_dict, block_size=self.block_size, min_size=self.min_size)
            stored.append(copy if count else None)
            shown.append(signpost.make(copy, _signpost_message(i, name)) if count else state_dict)
            if count and any(foreign.is_torchao(t) for t in iter_tensors(state_dict["state"])):
                torchao.append(i)
        if not any(s is not None for s in stored):
            return {"optimizer_states": shown}
        return {"optimizer_states": shown, signpost.LIGHTNING_STATES: stored, signpost.LIGHTNING_TORCHAO: torchao}

    def load_checkpoint(self, path, *args, **kwargs) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(path, *args, **kwargs)
        torchao = set(checkpoint.get(signpost.LIGHTNING_TORCHAO, ()))
        for i, state_dict in enumerate(checkpoint.get(signpost.LIGHTNING_STATES, ())):
            if state_dict is not None:
                _state.restored(state_dict, torchao=i in torchao)
        for key, value in checkpoint.items():  # Fabric's keys, and files `ckptq convert --replace` wrote in place
            if signpost.carries(value):
                _state.restored(value[signpost.CARRIED], torchao=bool(value.get(TORCHAO_FLAG)))
        for states in (checkpoint.get("optimizer_states"),):
            for value in states if isinstance(states, list) else ():
                if signpost.carries(value):
                    _state.restored(value[signpost.CARRIED], torchao=False)
        checkpoint = signpost.unwrapped(checkpoint)[0]
        for i in checkpoint.pop(FP32_KEY, ()):
            quant.decode_qstates(checkpoint["optimizer_states"][i])
        return checkpoint


def _signpost_message(index: int, name: str) -> str:
    return (f"ckptq: the state of optimizer {index} is stored under ckptq_optimizer_states in {name}, not in "
            "optimizer_states; resume with plugins=[ckptq.integrations.lightning.CkptqCheckpointIO()], or run "
            f"`ckptq expand {name} -o OUT.ckpt` for a checkpoint that Lightning resumes without ckptq")


def store_8bit_in_fabric() -> None:
    """From now on every ``lightning.Fabric`` made without a CheckpointIO plugin gets ``CkptqCheckpointIO``:
    the one line for code that builds its Fabric itself (litgpt: ``python -m ckptq.integrations.litgpt``)."""
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

    if getattr(Fabric.__init__, "_ckptq", False):
        return
    original = Fabric.__init__

    def init(self, *args, plugins=None, **kwargs):
        given = list(plugins) if isinstance(plugins, (list, tuple)) else [] if plugins is None else [plugins]
        if not any(isinstance(p, CheckpointIO) for p in given):
            given.append(CkptqCheckpointIO())
        original(self, *args, plugins=given, **kwargs)

    init._ckptq = True
    Fabric.__init__ = init
