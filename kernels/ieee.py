"""Correctly rounded fp32 square roots on every device: the one operation of the kernels' contract that
torch's CPU ops do not round as the C and Triton kernels do (their ``sqrt_rn``). A leaf module, so the rules
(``ckptq.kernels.rules``) and every backend can use it."""

from __future__ import annotations

import numpy as np
import torch


def ieee_sqrt(x: torch.Tensor) -> torch.Tensor:
    """sqrt(x) as a new fp32 tensor, correctly rounded (see ``ieee_sqrt_into``)."""
    return ieee_sqrt_into(x, torch.empty(x.shape, dtype=torch.float32, device=x.device))


def ieee_sqrt_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = sqrt(x) in fp32, correctly rounded (as the kernels' sqrt_rn); x any float dtype, out fp32.
    torch's CPU fp32 sqrt is 1 ulp off on ~20% of inputs, numpy's is IEEE, and so is CUDA's sqrtf."""
    if out.device.type != "cpu":
        return torch.sqrt(x.float(), out=out)
    if x.dtype != torch.float32:
        x = out.copy_(x)
    np.sqrt(x.numpy(), out=out.numpy())
    return out
