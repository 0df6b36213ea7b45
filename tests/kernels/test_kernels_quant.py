"""The Triton quantize/dequantize kernels against the PyTorch reference (on the CPU), bit for bit.

On a CUDA machine the kernels run on the GPU; elsewhere on the CPU through the Triton interpreter
(sizes stay small because it executes every program in numpy). Irregular sizes exercise the masking
of the last (short) block and of the last program.
"""

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import

pytest.importorskip("triton")

from ckptq.codec import codebooks, ops  # noqa: E402
from ckptq.errors import UsageError  # noqa: E402

BLOCK_SIZES = (64, 256, 4096)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _sample(shape, dtype, non_negative: bool, seed: int) -> torch.Tensor:
    """Values spanning six decades, so that small codes near zero are hit as well as large ones."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * 10.0 ** torch.empty(shape).uniform_(-6, 0, generator=gen)
    return (x.abs() if non_negative else x).to(dtype)


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """fp32 tensors equal bit for bit: stricter than torch.equal on -0.0, and NaN equals NaN."""
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
    differ = (got.view(torch.int32) != want.view(torch.int32)) & ~(got.isnan() & want.isnan())  # NaN payloads vary by device
    assert not bool(differ.any()), f"{int(differ.sum())} {what} differ"


def _kernel(fn, *tensors_then_args):
    """Run a kernel wrapper on DEVICE; results back on the CPU."""
    args = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in tensors_then_args]
    out = fn(*args)
    return tuple(t.cpu() for t in out) if isinstance(out, tuple) else out.cpu()


def _assert_matches_reference(x, qmap, block_size, transform):
    codes, absmax = _kernel(ops.quantize_blockwise, x, qmap, block_size, transform, "triton")
    ref_codes, ref_absmax = ops.quantize_blockwise(x, qmap, block_size, transform, backend="torch")
    assert codes.dtype == torch.uint8 and absmax.dtype == torch.float32
    assert torch.equal(codes, ref_codes), f"{int((codes != ref_codes).sum())} codes differ"
    _assert_same_bits(absmax, ref_absmax, "scales")
    out = _kernel(ops.dequantize_blockwise, codes, absmax, qmap, block_size, transform, "triton")
    ref_out = ops.dequantize_blockwise(ref_codes, ref_absmax, qmap, block_size, transform, backend="torch")
    _assert_same_bits(out, ref_out, "decoded values")


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("shape_kind", ["one", "block-1", "block+1", "odd", "2d"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
@pytest.mark.parametrize("transform", ["none", "sqrt"])
def test_matches_reference(block_size, shape_kind, dtype, signed, transform):
    shape = {"one": (1,), "block-1": (block_size - 1,), "block+1": (block_size + 1,), "odd": (4999,), "2d": (37, 91)}
    non_negative = transform == "sqrt" or not signed
    x = _sample(shape[shape_kind], dtype, non_negative, seed=block_size + len(shape_kind))
    _assert_matches_reference(x, codebooks.dynamic_map(signed), block_size, transform)


@pytest.mark.parametrize("transform", ["none", "sqrt"])
def test_all_zero_blocks_get_scale_zero_and_the_code_of_zero(transform):
    x = _sample((5 * 256 + 17,), torch.float32, non_negative=True, seed=1)
    x[256:512] = 0.0
    x[768:1024] = -0.0
    x[1280:] = 0.0  # the short last block
    qmap = codebooks.dynamic_map(False)
    codes, absmax = _kernel(ops.quantize_blockwise, x, qmap, 256, transform, "triton")
    assert torch.equal(absmax[[1, 3, 5]], torch.zeros(3))
    zero_code = int((qmap == 0).nonzero())
    assert bool((codes[256:512] == zero_code).all()) and bool((codes[1280:] == zero_code).all())
    _assert_matches_reference(x, qmap, 256, transform)
    _assert_matches_reference(torch.zeros(100), qmap, 64, transform)


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
@pytest.mark.parametrize("scale", [1.0, 2.0**-10, 4.0])
def test_ties_on_midpoints_go_to_the_lower_code(signed, scale):
    # One block per probe set: [absmax, t[j]*absmax, just below, just above]; power-of-two scales keep
    # y = x / absmax exactly on (or one ulp beside) the midpoint.
    qmap = codebooks.dynamic_map(signed)
    t = ops.midpoints(qmap)  # [255]
    probes = torch.cat([t, torch.nextafter(t, torch.tensor(-2.0)), torch.nextafter(t, torch.tensor(2.0))])
    block = torch.cat([torch.ones(1), probes, torch.zeros(1024 - 1 - probes.numel())])
    x = block * scale
    codes, _ = _kernel(ops.quantize_blockwise, x, qmap, 1024, "none", "triton")
    expected = (t[None, :] < block[:, None]).sum(dim=1)  # brute-force #{t < y}
    assert torch.equal(codes.long(), expected)
    _assert_matches_reference(x, qmap, 1024, "none")


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # numpy, inside the interpreter
@pytest.mark.parametrize("transform", ["none", "sqrt"])
def test_non_finite_values_match_reference(transform):
    x = _sample((4 * 64,), torch.float32, non_negative=transform == "sqrt", seed=2)
    x[3], x[70], x[140], x[141], x[200] = float("nan"), float("inf"), float("-inf"), 0.5, float("inf")
    _assert_matches_reference(x, codebooks.dynamic_map(True), 64, transform)


def test_non_contiguous_input_is_read_and_not_modified():
    x = _sample((91, 37), torch.bfloat16, non_negative=False, seed=3).t()  # [37, 91], not contiguous
    before = x.clone()
    _assert_matches_reference(x, codebooks.dynamic_map(True), 64, "none")
    assert torch.equal(x, before)


def test_empty_input():
    qmap = codebooks.dynamic_map(True)
    codes, absmax = _kernel(ops.quantize_blockwise, torch.empty(0), qmap, 256, "none", "triton")
    assert codes.shape == (0,) and absmax.shape == (0,)
    assert _kernel(ops.dequantize_blockwise, codes, absmax, qmap, 256, "none", "triton").shape == (0,)


def test_bad_arguments_raise_usage_errors():
    qmap, x = codebooks.dynamic_map(True).to(DEVICE), torch.ones(300, device=DEVICE)
    with pytest.raises(UsageError, match="int32"):
        ops.quantize_blockwise(x.int(), qmap, 256, "none", backend="triton")
    with pytest.raises(UsageError, match="block size"):
        ops.quantize_blockwise(x, qmap, 100, "none", backend="triton")
    with pytest.raises(UsageError, match="codebook"):
        ops.quantize_blockwise(x, qmap[:255], 256, "none", backend="triton")
    with pytest.raises(UsageError, match="transform"):
        ops.quantize_blockwise(x, qmap, 256, "log", backend="triton")
    codes, absmax = ops.quantize_blockwise(x, qmap, 256, "none", backend="triton")
    with pytest.raises(UsageError, match="absmax"):
        ops.dequantize_blockwise(codes, absmax[:1], qmap, 256, "none", backend="triton")
    with pytest.raises(UsageError, match="uint8"):
        ops.dequantize_blockwise(codes.int(), absmax, qmap, 256, "none", backend="triton")
