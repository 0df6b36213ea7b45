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


def qstate_widths(obj) -> set[int]:
    """The code widths of the quantized states anywhere inside a loaded object: {8} for ckptq's 8-bit form of
    fp32 moments, {6, 2} for its 4-bit one (exp_avg a 6-bit ratio over a 2-bit second moment)."""
    from ckptq.codec.qstate import is_qstate

    if is_qstate(obj):
        return {int(obj["bits"])}
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return set().union(*(qstate_widths(v) for v in values))
