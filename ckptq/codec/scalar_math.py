"""Arithmetic that runs on Python floats or on float64 tensors and gives the same results: the optimizers'
per-step scalars (bias corrections, eps' of the ratio transform, ...) are written once against it and
evaluated on the host (``HOST``, ``capturable=False``) or on the parameters' device (``DeviceMath``,
``capturable=True``) from the step tensors there, with nothing read back to the host.

A formula takes the math namespace ``x`` first and uses Python's ``+ - *`` and comparisons, which are
correctly rounded on floats and float64 tensors alike, and ``x.pow``, ``x.sqrt``, ``x.div``, ``x.where``,
``x.maximum`` for the rest:

- ``div`` is a true IEEE division on the device: torch's ``float / tensor`` multiplies by the
  reciprocal, and so does CUDA's ``tensor / float``.
- ``pow``: Python's ``**`` is libm's pow. On the CPU, ATen's vectorized loop computes pow with SLEEF,
  which differs from libm in the last bit for ~1-2% of these values, while its element-by-element loop
  (taken when an operand is not contiguous) calls libm's pow. ``DeviceMath`` hands pow non-contiguous
  operands on the CPU, so the host and the device give the same float64 bits there (pinned by
  tests/optim/test_capturable.py over 10**5 steps). ``sqrt`` is pow(x, 0.5) there, as Python's ``x ** 0.5`` is.
- On CUDA, pow is CUDA's (within 2 ulp of float64); a result can differ from the host's in its last
  bits, and the fp32 values the kernels take only where those bits decide the fp32 rounding.
"""

from __future__ import annotations

import math
import operator
import struct

import torch


class HostMath:
    """Python floats (and whatever the host formula was given: 0-dim tensors compute as torch does)."""

    pow = staticmethod(operator.pow)
    div = staticmethod(operator.truediv)
    maximum = staticmethod(max)
    minimum = staticmethod(min)
    exp = staticmethod(math.exp)
    log = staticmethod(math.log)

    @staticmethod
    def f32(v):
        """v rounded to fp32 (and back to a float): what an fp32 tensor of it holds."""
        return struct.unpack("f", struct.pack("f", v))[0]

    @staticmethod
    def sqrt(v):
        return v**0.5  # libm's pow, as the host formulas always computed it

    @staticmethod
    def where(condition, a, b):
        return a if condition else b


HOST = HostMath()


def _element_by_element(t: torch.Tensor) -> torch.Tensor:
    """A non-contiguous float64 copy of ``t``: ATen's CPU kernels then call libm per element."""
    out = torch.empty((*t.shape, 2), dtype=torch.float64, device=t.device)[..., 0]
    return out.copy_(t)


class DeviceMath:
    """float64 tensor operations on one device (floats among the operands are broadcast scalars)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cpu = self.device.type == "cpu"

    def tensor(self, v) -> torch.Tensor:
        """``v`` as a float64 tensor on the device (a Python float: a 0-dim one, made by a fill kernel)."""
        if isinstance(v, torch.Tensor):
            return v.to(self.device, torch.float64)
        return torch.full((), v, dtype=torch.float64, device=self.device)

    def upload(self, values: list[float]) -> torch.Tensor:
        """float64 [len(values)] on the device, copied from pinned memory without waiting for the device
        (torch's caching host allocator keeps the pinned block until the copy has run)."""
        host = torch.tensor(values, dtype=torch.float64)
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def pow(self, a, b):
        if not any(isinstance(v, torch.Tensor) for v in (a, b)):
            return a**b
        if self.cpu:
            return torch.pow(_element_by_element(self.tensor(a)), _element_by_element(self.tensor(b)))
        return torch.pow(a, b)

    def sqrt(self, v):
        if not isinstance(v, torch.Tensor):
            return v**0.5
        return self.pow(v, 0.5) if self.cpu else torch.sqrt(v)

    def div(self, a, b):
        if not any(isinstance(v, torch.Tensor) for v in (a, b)):
            return a / b
        return torch.div(self.tensor(a), self.tensor(b))

    def where(self, condition, a, b):
        if not isinstance(condition, torch.Tensor):
            return a if condition else b
        return torch.where(condition, self.tensor(a), self.tensor(b))

    def maximum(self, a, b):
        if not any(isinstance(v, torch.Tensor) for v in (a, b)):
            return max(a, b)
        return torch.maximum(self.tensor(a), self.tensor(b))

    def minimum(self, a, b):
        if not any(isinstance(v, torch.Tensor) for v in (a, b)):
            return min(a, b)
        return torch.minimum(self.tensor(a), self.tensor(b))

    def _unary(self, fn, host, v):
        """``fn`` elementwise. Unlike ``pow``, ATen's CPU exp and log differ from libm's in the last bit for
        ~0.5% of float64 inputs however they are laid out: formulas that use them (AdEMAMix's beta3 schedule)
        can differ from the host's there, and in the fp32 value only where that bit decides the rounding."""
        return host(v) if not isinstance(v, torch.Tensor) else fn(self.tensor(v))

    def exp(self, v):
        return self._unary(torch.exp, math.exp, v)

    def log(self, v):
        return self._unary(torch.log, math.log, v)

    def f32(self, v):
        """v rounded to fp32, as float64."""
        return HostMath.f32(v) if not isinstance(v, torch.Tensor) else v.to(torch.float32).to(torch.float64)
