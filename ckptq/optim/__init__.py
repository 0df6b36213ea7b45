"""8-bit and 4-bit Adam/AdamW (``optimizer``) and SGD, Lion, Muon (``momentum``) that keep their torch
counterparts' state keys and resume from ``ckptq`` checkpoints, their argument checks (``args``), state-dict import and export (``state_io``) and the
step (``adam``)."""

from ..errors import StateMismatchError
from .momentum import Lion4bit, Lion8bit, Muon4bit, Muon8bit, SGD4bit, SGD8bit
from .optimizer import Adam4bit, Adam8bit, AdamW4bit, AdamW8bit
from .state_io import expand_on_load, to_torch_state_dict

__all__ = ["AdamW8bit", "Adam8bit", "AdamW4bit", "Adam4bit", "SGD8bit", "SGD4bit", "Lion8bit", "Lion4bit",
           "Muon8bit", "Muon4bit", "StateMismatchError", "expand_on_load", "to_torch_state_dict"]
