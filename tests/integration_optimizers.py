"""The optimizers the accelerate and Lightning integration tests train with, by name: torch AdamW, ckptq's
AdamW8bit, and torchao's AdamW8bit / AdamW4bit (skipped where torchao is not installed)."""

from __future__ import annotations

import pytest
import torch

from ckptq.optim import AdamW8bit

EXACT = ("AdamW8bit", "torchao AdamW8bit", "torchao AdamW4bit")  # stored without a bit changed


def optimizer_class(name: str):
    if name.startswith("torchao"):
        return getattr(pytest.importorskip("torchao.optim"), name.split()[1])
    return AdamW8bit if name == "AdamW8bit" else torch.optim.AdamW
