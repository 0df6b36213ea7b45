"""The plain facts every part of ckptq shares (no torch needed, so the CLI can show them in ``--help``
without importing it): Adam's state keys, the default min size, the block sizes and budgets."""

from ..errors import UsageError

MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # torch.optim.Adam(W)'s state keys, in step order
SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq")
RATIO_PAIRS = {"exp_avg": "exp_avg_sq"}  # state key -> the key of the second moment it is stored relative to
DEFAULT_MIN_SIZE = 4096  # smaller states stay exact fp32: their codebooks and scales would not pay for themselves
BLOCK_SIZES = tuple(2**k for k in range(6, 13))  # 64 ... 4096: values per absmax scale
# What users choose: bits per value on average over a param's two moments (``policy.convert_width`` gives
# each state of a converted file its width), and the block size by that budget, chosen by update fidelity
# (tools/bench/fidelity.py): 4 bits at block 128 keep the two moments at 1.0625 bytes per parameter.
BUDGETS = (8, 4)
DEFAULT_BLOCK_SIZES = {8: 256, 4: 128}
DEFAULT_BLOCK_SIZE = DEFAULT_BLOCK_SIZES[8]
LAYOUTS = ("flat", "rows")  # blocks over all elements (format 1, 2) or along rows (format 3)
RATIO_TRANSFORM = "ratio"
TRANSFORMS = ("none", "sqrt", RATIO_TRANSFORM)  # "none" and "sqrt" are the kernels' (ops.TRANSFORMS)


def check_block_size(block_size: int) -> int:
    if isinstance(block_size, bool) or block_size not in BLOCK_SIZES:
        raise UsageError(f"block size {block_size!r} is not supported; use a power of two from 64 to 4096")
    return block_size
