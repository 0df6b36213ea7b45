"""ckptq's low-bit optimizers: one engine (``engine``: state, step plans, state dicts, validation) and one file
per optimizer, each keeping its torch counterpart's arguments and state keys and resuming from ``ckptq``
checkpoints: Adam/AdamW (``adam``), SGD (``sgd``), Lion (``lion``), Muon (``muon``), RMSprop (``rmsprop``),
Adagrad (``adagrad``), NAdam (``nadam``), RAdam (``radam``), AdEMAMix (``ademamix``). docs/optimizers.md
says how to add one."""

from ..errors import StateMismatchError
from .adagrad import Adagrad4bit, Adagrad8bit
from .adam import Adam4bit, Adam8bit, AdamW4bit, AdamW8bit
from .ademamix import AdEMAMix4bit, AdEMAMix8bit
from .engine import LowBitOptimizer
from .lion import Lion4bit, Lion8bit
from .muon import Muon4bit, Muon8bit
from .nadam import NAdam4bit, NAdam8bit
from .radam import RAdam4bit, RAdam8bit
from .rmsprop import RMSprop4bit, RMSprop8bit
from .sgd import SGD4bit, SGD8bit
from .state_io import expand_on_load, to_torch_state_dict

__all__ = ["AdamW8bit", "Adam8bit", "AdamW4bit", "Adam4bit", "SGD8bit", "SGD4bit", "Lion8bit", "Lion4bit",
           "Muon8bit", "Muon4bit", "RMSprop8bit", "RMSprop4bit", "Adagrad8bit", "Adagrad4bit", "NAdam8bit",
           "NAdam4bit", "RAdam8bit", "RAdam4bit", "AdEMAMix8bit", "AdEMAMix4bit", "LowBitOptimizer",
           "StateMismatchError", "expand_on_load", "to_torch_state_dict"]
