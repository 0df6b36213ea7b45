"""The golden objects of the roles (docs/FORMAT.md, "Roles"): one per optimizer, the fp32 state dict it saves
(made up, deterministic, shaped as the real class's: rows that are not whole blocks, a small state kept
exact), planned by ckptq's own planner at 8 and at 4 bits. ``tests/format/test_golden.py`` pins the files.

Regenerate (only when a role's codec deliberately changes): CKPTQ_REGEN_GOLDEN=1 pytest tests/format/test_golden.py
"""

import os

import torch

from ckptq.codec import tree
from tests.helpers.paths import GOLDEN as GOLDEN_DIR
MIN_SIZE, BLOCKS = 64, {8: 64, 4: 64}


def _tensors(seed: int, **shapes):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) * 1e-2 for k, s in shapes.items()}


def _sd(state: dict, group: dict) -> dict:
    return {"state": state, "param_groups": [{"lr": 1e-3, "weight_decay": 0.0, **group, "params": sorted(state)}]}


def _sgd():
    t = _tensors(1, m=(20, 15), n=(301,), b=(7,))
    return _sd({0: {"momentum_buffer": t["m"]}, 1: {"momentum_buffer": t["b"]}, 2: {"momentum_buffer": t["n"]}},
               {"momentum": 0.9, "dampening": 0, "nesterov": True, "maximize": False})


def _muon_adamw():
    t = _tensors(2, m=(20, 15), e=(301,))
    muon = _sd({0: {"momentum_buffer": t["m"]}}, {"momentum": 0.95, "nesterov": True, "eps": 1e-7, "ns_steps": 5,
                                                   "ns_coefficients": (3.4445, -4.775, 2.0315), "adjust_lr_fn": None})
    adamw = _sd({0: {"step": torch.tensor(9.0), "exp_avg": t["e"], "exp_avg_sq": t["e"] ** 2 + 1e-6}},
                {"betas": (0.9, 0.95), "eps": 1e-8, "amsgrad": False, "decoupled_weight_decay": True})
    return [muon, adamw]


def _lion():
    t = _tensors(3, m=(19, 15), n=(301,))
    return _sd({0: {"exp_avg": t["m"]}, 1: {"exp_avg": t["n"]}}, {"betas": (0.9, 0.99)})


def _rmsprop():
    t = _tensors(4, a=(20, 15), m=(20, 15))
    return _sd({0: {"step": torch.tensor(9.0), "square_avg": t["a"] ** 2 + 4e-4, "momentum_buffer": t["m"],
                    "grad_avg": t["a"]}}, {"alpha": 0.99, "eps": 1e-8, "centered": True, "momentum": 0.9})


def _adagrad():
    t = _tensors(5, s=(20, 15), n=(301,))
    return _sd({0: {"step": torch.tensor(9.0), "sum": t["s"] ** 2 * 9}, 1: {"step": torch.tensor(9.0), "sum": t["n"] ** 2}},
               {"lr_decay": 0, "eps": 1e-10, "initial_accumulator_value": 0})


def _adamax():
    t = _tensors(6, m=(20, 15), u=(20, 15))
    return _sd({0: {"step": torch.tensor(9.0), "exp_avg": t["m"], "exp_inf": t["u"].abs() + 1e-8}},
               {"betas": (0.9, 0.999), "eps": 1e-8})


def _adafactor():
    t = _tensors(7, m=(20, 15), r=(20,), c=(15,), v=(301,), n=(301,))
    state = {0: {"step": 9, "exp_avg": t["m"], "exp_avg_sq_row": t["r"] ** 2, "exp_avg_sq_col": t["c"] ** 2,
                 "RMS": torch.tensor(0.5)},
             1: {"step": 9, "exp_avg": t["n"], "exp_avg_sq": t["v"] ** 2, "RMS": torch.tensor(0.25)}}
    return _sd(state, {"eps": (1e-30, 1e-3), "clip_threshold": 1.0, "decay_rate": -0.8, "beta1": 0.9,
                       "scale_parameter": False, "relative_step": False, "warmup_init": False})


OPTIMIZERS = {"sgd": _sgd, "muon-adamw": _muon_adamw, "lion": _lion, "rmsprop": _rmsprop, "adagrad": _adagrad,
              "adamax": _adamax, "adafactor": _adafactor}


def path(name: str) -> str:
    return os.path.join(GOLDEN_DIR, f"v3-{name}.safetensors")


def golden_object(name: str) -> dict:
    """{"bits8": {"optimizer": ...}, "bits4": {...}}: the optimizer's state as ``ckptq convert`` plans it at each
    budget (its planner, its role codecs), quantized with the PyTorch reference backend."""
    out = {}
    for bits in (8, 4):
        obj = {"optimizer": OPTIMIZERS[name]()}
        tree.mark(obj, None, BLOCKS[bits], MIN_SIZE, bits, backend="torch")
        out[f"bits{bits}"] = obj
    return out
