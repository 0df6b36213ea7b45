"""Lightning and Fabric checkpoints with the optimizer states stored 8-bit (or 4-bit) inside the ``.ckpt``.

    from ckptq.integrations.lightning import CkptqCheckpointIO
    trainer = lightning.Trainer(..., plugins=[CkptqCheckpointIO()])        # bits=4: half that again
    trainer.fit(model, data, ckpt_path="last")           # resumes from the low-bit state
    fabric = lightning.Fabric(..., plugins=[CkptqCheckpointIO()])   # Fabric: the same plugin
    fabric.save(path, {"model": model, "optimizer": optimizer})     # fabric.load(path, state) resumes
    low_bit_checkpoints(fabric, bits=8)            # a Fabric that something else made: that one only

One plugin for both: Lightning's Trainer and Fabric take a ``CheckpointIO`` in ``plugins`` (Fabric's
connector hands it to the strategy, whose ``save_checkpoint``/``load_checkpoint`` go through it on one
device and under DDP; FSDP and DeepSpeed strategies write their own files). Nothing here patches Lightning.
litgpt builds its Fabric itself: ``python -m ckptq.integrations.litgpt`` gives it this plugin.

Fabric saves each optimizer's state under a key of its own (``"optimizer"``), not in ``optimizer_states``:
each such top-level state dict is stored as a signpost carrying its low-bit state (``ckptq.codec.signpost``),
which stock Fabric stops at (``ValueError: could not convert string to float: b'ckptq: ...'``) and this
plugin puts back. Files that ``ckptq convert FILE --replace`` converted in place hold the same signposts,
and this plugin resumes them too.

Saving, each fp32 Adam moment of an optimizer state becomes ckptq's 8-bit or 4-bit state dict (``ckptq
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
    """Lightning's ``TorchCheckpointIO`` with the optimizer states' Adam moments stored at ``bits`` bits per
    value (8 or 4, as ``ckptq convert --bits``; states of at least ``min_size`` elements, ``block_size`` values
    per scale, default 256 for 8 bits and 128 for 4), for ``lightning.Trainer(plugins=[...])`` and
    ``lightning.Fabric(plugins=[...])``. Loading takes files of either width. UsageError for ``bits`` other
    than 8 or 4."""

    def __init__(self, block_size: int | None = None, min_size: int = policy.DEFAULT_MIN_SIZE, *, bits: int = 8):
        super().__init__()
        self.options = _state.options(bits, block_size, min_size)
        self.bits, self.block_size, self.min_size = (self.options[k] for k in ("bits", "block_size", "min_size"))

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        name = os.path.basename(str(path))
        if checkpoint.get("optimizer_states"):  # Lightning's Trainer (a weights-only checkpoint has none)
            checkpoint = {**checkpoint, **self._stored(checkpoint["optimizer_states"], name)}
        checkpoint = {**checkpoint, **self._fabric_stored(checkpoint, name)}
        super().save_checkpoint(checkpoint, path, storage_options)

    def _fabric_stored(self, checkpoint: dict, name: str) -> dict:
        """Fabric's ``fabric.save(path, {"model": ..., "optimizer": ...})``: each optimizer state dict at the
        top level (under any key) as a signpost carrying its low-bit state, torchao's flagged for the load."""
        out = {}
        for key, value in checkpoint.items():
            if key == "optimizer_states" or not is_optimizer_state(value) or signpost.is_signpost(value):
                continue
            copy, count = _state.stored_low_bit(value, **self.options)
            if count:
                out[key] = signpost.make(copy, signpost.fabric_message(key, name, self.bits), copy)
                out[key][TORCHAO_FLAG] = any(foreign.is_torchao(t) for t in iter_tensors(value["state"]))
        return out

    def _stored(self, states: list, name: str) -> dict:
        """``optimizer_states`` with a signpost for each state stored in another form, and those states."""
        shown, stored, torchao = [], [], []
        for i, state_dict in enumerate(states):
            copy, count = _state.stored_low_bit(state_dict, **self.options)
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


def low_bit_checkpoints(fabric, *, bits: int = 8, block_size: int | None = None,
                        min_size: int = policy.DEFAULT_MIN_SIZE) -> CkptqCheckpointIO:
    """Give a ``lightning.Fabric`` that is already made (by a library, a script you do not edit) the plugin:
    from now on its ``fabric.save`` stores optimizer states at ``bits`` bits (8 or 4) and ``fabric.load`` reads
    them back. The same as ``Fabric(..., plugins=[CkptqCheckpointIO(bits=...)])``; that Fabric only, nothing
    else in the process changes. Returns the plugin. UsageError where the Fabric's strategy writes its own
    files (FSDP, DeepSpeed: convert those checkpoints afterwards with ``ckptq convert``) or already has a
    CheckpointIO plugin other than the default one."""
    from ..errors import UsageError

    strategy = fabric.strategy
    refusal = plugin_refusal(strategy)
    if refusal:
        raise UsageError(refusal)
    if isinstance(strategy.checkpoint_io, CkptqCheckpointIO):
        return strategy.checkpoint_io
    plugin = CkptqCheckpointIO(block_size, min_size, bits=bits)
    strategy.checkpoint_io = plugin
    return plugin


def plugin_refusal(strategy) -> str | None:
    """Why ``strategy`` (a Fabric's) cannot take ckptq's plugin, in one line, or None where it can or has it
    already: it writes its own checkpoint files (FSDP, DeepSpeed), or it saves through a CheckpointIO of the
    user's own."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO as Default

    if not takes_checkpoint_io(strategy):
        return (f"ckptq: this Fabric's strategy ({type(strategy).__name__}) writes its own checkpoint files, not "
                "through a CheckpointIO plugin; save as it does, then run `ckptq convert CHECKPOINT --replace` on "
                "what it wrote")
    current = strategy.checkpoint_io
    if type(current) is not Default and not isinstance(current, CkptqCheckpointIO):
        return (f"ckptq: this Fabric already saves through {type(current).__name__}, a CheckpointIO plugin of its "
                "own; ckptq's plugin would replace it. Keep one: drop that plugin, or subclass CkptqCheckpointIO "
                "with what it does")
    return None


def store_8bit_in_fabric(fabric=None) -> CkptqCheckpointIO:
    """Deprecated: ``low_bit_checkpoints(fabric)``, or ``lightning.Fabric(..., plugins=[CkptqCheckpointIO()])``;
    litgpt: ``python -m ckptq.integrations.litgpt``. Given a Fabric it is ``low_bit_checkpoints(fabric)``.
    Called without one it used to patch ``Fabric.__init__`` for the whole process, so that every Fabric made
    afterwards got the plugin; it no longer does (a process-wide patch reaches code that never asked for it)
    and says instead, in a UsageError, which of the three to use."""
    from .. import _deprecated
    from ..errors import UsageError

    _deprecated.warn("ckptq.integrations.lightning.store_8bit_in_fabric()",
                     "ckptq.integrations.lightning.low_bit_checkpoints(fabric), "
                     "lightning.Fabric(plugins=[ckptq.integrations.lightning.CkptqCheckpointIO()]), or "
                     "python -m ckptq.integrations.litgpt for litgpt")
    if fabric is None:
        raise UsageError("ckptq: store_8bit_in_fabric() no longer changes every Fabric of the process; give "
                         "your Fabric the plugin: lightning.Fabric(..., plugins=[CkptqCheckpointIO()]), or "
                         "low_bit_checkpoints(fabric) once it is made; litgpt: python -m ckptq.integrations.litgpt")
    return low_bit_checkpoints(fabric, bits=8)


def takes_checkpoint_io(strategy) -> bool:
    """Whether a Fabric with ``strategy`` (a name, as ``Fabric(strategy="ddp")`` takes it, or an instance) saves
    through a CheckpointIO plugin: FSDP and ModelParallel refuse one (NotImplementedError) and DeepSpeed writes
    its own files; their checkpoints convert afterwards (``ckptq convert``)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY, DeepSpeedStrategy, Strategy

    if isinstance(strategy, str):
        # "auto" (not in the registry) is one of the plain strategies, or FSDP when a plugin asks for it
        cls = STRATEGY_REGISTRY[strategy]["strategy"] if strategy in STRATEGY_REGISTRY else Strategy
    else:
        cls = type(strategy)
    own_setter = getattr(cls, "checkpoint_io", None)
    return not issubclass(cls, DeepSpeedStrategy) and getattr(own_setter, "fset", None) is Strategy.checkpoint_io.fset
