"""The options of ``convert``, ``expand`` and ``info``, checked once (``checked()``), before any input is
read: every source takes the same validated object."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from ..codec import policy
from ..errors import UsageError

Progress = Callable[[int, int], None]  # (bytes done, bytes total)
# Like transformers' save_pretrained: files stay easy to move, upload (hubs cap single files) and
# re-read in parallel; a checkpoint under this size is one file.
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9


def _whole(value, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UsageError(f"{name} {value!r} must be a whole number >= {low}")
    return value


@dataclass(frozen=True)
class ConvertOptions:
    output: str | None = None  # None: beside the input, named by ``bits``
    bits: int | None = 8  # budget per value: 8, or 4 (a 6-bit ratio over a 2-bit second moment); None: auto
    block_size: int | None = None  # None: policy.default_block_size(bits)
    min_size: int = policy.DEFAULT_MIN_SIZE
    key: str | None = None  # '/'-separated path to the optimizer state dict (default: found by shape)
    device: str = "auto"  # where quantization runs: auto, cpu, cuda[:N]
    backend: str = "auto"
    compress_level: int | None = None  # None: no zstd stage
    compress_threads: int = 0
    max_shard_size: int | None = DEFAULT_MAX_SHARD_SIZE
    force: bool = False
    trust: bool = False
    replace: bool = False
    keep_last: int = 0  # a run's folder: leave the newest N checkpoints as they are
    progress: Progress | None = None
    auto_bits: bool = False  # bits were not given: a 4-bit input stays 4-bit (``narrowed``)

    def checked(self) -> "ConvertOptions":
        """These options with the block size resolved; UsageError naming the bad value and the fix."""
        auto = self.bits is None and self.block_size is None
        bits = 8 if self.bits is None else policy.check_budget(self.bits)
        block = policy.default_block_size(bits) if self.block_size is None else policy.check_block_size(self.block_size)
        policy.check_min_size(self.min_size)
        _whole(self.keep_last, "--keep-last", 0)
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise UsageError(f"device {self.device!r} is not one of auto, cpu, cuda")
        if self.compress_level is not None and not (1 <= self.compress_level <= 22 and self.compress_threads >= 0):
            raise UsageError(f"compression level {self.compress_level} / threads {self.compress_threads}: use a level "
                             "from 1 to 22 and threads >= 0 (0 = all cores)")
        if self.max_shard_size is not None:
            _whole(self.max_shard_size, "max shard size", 1)
        return dataclasses.replace(self, bits=bits, block_size=block, auto_bits=auto)

    def with_output(self, output: str | None) -> "ConvertOptions":
        return dataclasses.replace(self, output=output)

    def narrowed(self, input_bits: int) -> "ConvertOptions":
        """Without ``--bits``: no wider than the input's state (torchao's 4-bit state stays 4-bit; at 8 bits
        its file grew 1.19x). An output named for 8 bits is named for 4."""
        if not self.auto_bits or input_bits >= self.bits:
            return self
        out = self.output[: -len(".q8.safetensors")] + ".q4.safetensors" if self.output and \
            self.output.endswith(".q8.safetensors") else self.output
        return dataclasses.replace(self, bits=input_bits, block_size=policy.default_block_size(input_bits), output=out)


@dataclass(frozen=True)
class ExpandOptions:
    output: str | None = None  # None: beside the input (``ckpt.fp32.pt``; a framework's own file names)
    force: bool = False
    verify: bool = True  # check every stored tensor's checksum
    trust: bool = False  # a .pt input: allow full unpickling
    replace: bool = False
    progress: Progress | None = None

    def checked(self) -> "ExpandOptions":
        return self

    def with_output(self, output: str | None) -> "ExpandOptions":
        return dataclasses.replace(self, output=output)


@dataclass(frozen=True)
class InfoOptions:
    bits: int = 8  # for inputs with fp32 moments: what convert at this budget would write
    block_size: int | None = None
    min_size: int = policy.DEFAULT_MIN_SIZE
    key: str | None = None
    trust: bool = False

    def checked(self) -> "InfoOptions":
        bits = policy.check_budget(self.bits)
        block = policy.default_block_size(bits) if self.block_size is None else policy.check_block_size(self.block_size)
        policy.check_min_size(self.min_size)
        return dataclasses.replace(self, bits=bits, block_size=block)
