"""8-bit and 4-bit Adam/AdamW that keep PyTorch's state keys and resume from ``ckptq`` checkpoints
(``optimizer``), their argument checks (``args``), state-dict import and export (``state_io``) and the
step (``adam``)."""

from ..errors import StateMismatchError
from .optimizer import Adam4bit, Adam8bit, AdamW4bit, AdamW8bit
from .state_io import expand_on_load, to_torch_state_dict

__all__ = ["AdamW8bit", "Adam8bit", "AdamW4bit", "Adam4bit", "StateMismatchError", "expand_on_load",
           "to_torch_state_dict"]
