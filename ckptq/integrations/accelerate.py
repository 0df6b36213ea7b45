"""accelerate's ``save_state``/``load_state`` with the optimizer's Adam moments stored 8-bit (or 4-bit).

    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    ckptq.integrations.accelerate.low_bit_checkpoints(optimizer)   # bits=4: half that again
    accelerator.save_state("ckpt")      # ckpt/optimizer.bin: 8-bit moments, ~1/4 of torch AdamW's fp32 file
    accelerator.load_state("ckpt")      # torch AdamW gets fp32 moments back (decoded), AdamW8bit its own state

accelerate writes ``optimizer.bin`` with ``torch.save(optimizer.state_dict())`` and its ``load_state``
requires that file (removing it makes ``load_state`` fail with FileNotFoundError), and its save/load
hooks see only the models. So the state goes low-bit where accelerate takes it: ``low_bit_checkpoints``
saves nothing itself; it registers torch's own optimizer hooks, a ``state_dict`` post-hook that stores the
fp32 Adam moments as ckptq's 8-bit or 4-bit state dicts (``ckptq convert``'s plan) and a ``load_state_dict``
pre-hook that gives the optimizer its own form back: fp32 for torch's optimizers, torchao's
``OptimState8bit``/``OptimState4bit`` for torchao's ``AdamW8bit``/``AdamW4bit``, whose states are stored as
qstates with the very same codes (``ckptq.integrations._state`` says why), so that they resume exactly.
``optimizer.bin`` stays a torch.save file that ``torch.load(weights_only=True)`` reads without torchao and
``ckptq info`` describes. ckptq's ``AdamW8bit`` needs nothing of this: its ``state_dict`` is 8-bit already.
No import of accelerate is needed here; anything that saves ``optimizer.state_dict()`` (a plain
``torch.save`` loop) gets the same.

The low-bit state is saved as a signpost that carries it (``ckptq.codec.signpost``): plain accelerate (no
``low_bit_checkpoints`` when loading) stops in ``load_state`` with ``ValueError: could not convert string to
float: b'ckptq: ...'`` naming the fixes, where it used to load the 8-bit dicts and fail at the first step
(``'dict' object has no attribute 'lerp_'``). Back to plain accelerate: ``ckptq expand ckpt --replace``
rewrites ``optimizer.bin`` with fp32 moments under the same name.
"""

from __future__ import annotations

import torch

from .. import _deprecated
from ..codec import policy, signpost
from . import _state


def low_bit_checkpoints(optimizer: torch.optim.Optimizer, *, bits: int = 8, block_size: int | None = None,
                        min_size: int = policy.DEFAULT_MIN_SIZE) -> torch.optim.Optimizer:
    """From now on ``optimizer.state_dict()`` holds its Adam moments at ``bits`` bits per value (8 or 4, as
    ``ckptq convert --bits``; states of at least ``min_size`` elements, ``block_size`` values per scale,
    default 256 for 8 bits and 128 for 4) and ``optimizer.load_state_dict`` takes such state back in the
    optimizer's own form (``_state.for_optimizer``: fp32, or torchao's). Nothing is saved now: checkpoints
    that ``accelerator.save_state`` (or any ``torch.save(optimizer.state_dict())``) writes later are low-bit.
    Call it on the prepared optimizer (or the one it wraps); returns ``optimizer``. A ckptq optimizer
    (``AdamW8bit``, ``SGD8bit``, ``Lion8bit``, ``Muon8bit``...) is returned unchanged (its state is low-bit
    already). UsageError for ``bits`` other than 8 or 4, or a block size that is not a power of two 64..4096."""
    options = _state.options(bits, block_size, min_size)
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the torch one
    if not _state.is_ckptq_optimizer(inner):
        inner.register_state_dict_post_hook(lambda opt, state_dict: _signposted(
            *_state.stored_low_bit(state_dict, **options)))
        inner.register_load_state_dict_pre_hook(_state.for_optimizer)
    return optimizer


def store_8bit(optimizer: torch.optim.Optimizer, *, block_size: int = 256,
               min_size: int = policy.DEFAULT_MIN_SIZE) -> torch.optim.Optimizer:
    """Deprecated: ``low_bit_checkpoints(optimizer)`` (8 bits; ``bits=4`` for 4)."""
    _deprecated.warn("ckptq.integrations.accelerate.store_8bit", "ckptq.integrations.accelerate.low_bit_checkpoints")
    return low_bit_checkpoints(optimizer, bits=8, block_size=block_size, min_size=min_size)


MESSAGE = ("ckptq: this optimizer state was saved low-bit by ckptq.integrations.accelerate.low_bit_checkpoints; "
           "call low_bit_checkpoints(optimizer) after accelerator.prepare and before load_state, or run "
           "`ckptq expand DIR --replace` for the fp32 optimizer.bin that plain accelerate loads")


def _signposted(state_dict: dict, count: int) -> dict:
    """A state dict with low-bit states as a signpost carrying it: plain accelerate's load_state stops at it
    with ``MESSAGE`` (it loaded the 8-bit dicts and failed at the first step: 'dict' object has no attribute
    'lerp_'); ``for_optimizer`` takes the carried state."""
    return signpost.make(state_dict, MESSAGE, state_dict) if count else state_dict
