"""The Triton kernels on the row layout (``ckptq/kernels/contract.py``, "Rows": blocks never cross a row,
the last block of a row may be short, each row's codes start on a byte) against the PyTorch reference,
bit for bit: quantize, dequantize and the fused step at every width and width mix, on row lengths that are
and are not multiples of the block (1, block - 1, block + 1, 201, a whole block, several), fp32/bf16/fp16
params and grads, amsgrad, maximize, stochastic (seeded) and nearest rounding. On the CPU the kernels run
in Triton's interpreter (conftest.py): small sizes.
"""

import os

import pytest
import torch

from ckptq.codec import codebooks, ops, policy
from tests.kernels.test_native import _assert_same, _special

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton runs here only under TRITON_INTERPRET=1 (set by conftest.py)", allow_module_level=True)
pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 64
ROW_LENS = (1, BLOCK - 1, BLOCK + 1, 201, 2 * BLOCK)  # the last: whole blocks, the flat layout
MAPS = {8: (codebooks.dynamic_map(True), codebooks.dynamic_map(False)),
        6: (policy.ratio_policy(6).qmap(), codebooks.power_map(False, 3.0)[::4].contiguous()),
        4: (policy.ratio_policy(4).qmap(), policy.policy_for("exp_avg_sq", 4).qmap()),
        2: (torch.tensor([-1.0, 0.0, 0.5, 1.0]), policy.policy_for("exp_avg_sq", 2).qmap())}


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # numpy, inside the interpreter
@pytest.mark.parametrize("row_len", ROW_LENS)
@pytest.mark.parametrize("bits", (8, 6, 4, 2))
def test_quantize_and_dequantize_rows_match_the_reference(bits, row_len):
    rows = 3 if row_len > 1 else 5
    dtype = (torch.float32, torch.bfloat16, torch.float16)[(bits + row_len) % 3]
    gen = torch.Generator().manual_seed(bits * 1000 + row_len)
    x = _special(rows * row_len, True, gen)
    x = torch.where(x.abs() < 6e4, x, x.sign() * 6e4).to(dtype) if dtype == torch.float16 else x.to(dtype)
    for qmap, transform in zip(MAPS[bits], ("none", "sqrt")):
        src = x if transform == "none" else x.abs()
        c1, a1 = ops.quantize_blockwise(src, qmap, BLOCK, transform, "torch", bits=bits, row_len=row_len)
        c2, a2 = ops.quantize_blockwise(src.to(DEVICE), qmap.to(DEVICE), BLOCK, transform, "triton", bits=bits,
                                        row_len=row_len)
        assert torch.equal(c1, c2.cpu())
        _assert_same(a1, a2.cpu())
        d1 = ops.dequantize_blockwise(c1, a1, qmap, BLOCK, transform, "torch", bits=bits, numel=src.numel(),
                                      row_len=row_len)
        d2 = ops.dequantize_blockwise(c1.to(DEVICE), a1.to(DEVICE), qmap.to(DEVICE), BLOCK, transform, "triton",
                                      bits=bits, numel=src.numel(), row_len=row_len)
        _assert_same(d1, d2.cpu())


def row_states(widths, n: int, row_len: int, amsgrad: bool, gen: torch.Generator, block: int = BLOCK):
    """exp_avg (ratio codes), exp_avg_sq[, max_exp_avg_sq] (sqrt) of n elements in rows of row_len, quantized
    by the reference at the given widths: [(codes, absmax, qmap)]."""
    dense = [torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 1e-2, torch.rand(n, generator=gen) * 2e-2]
    out = []
    for i, (x, bits) in enumerate(list(zip(dense, widths))[: 3 if amsgrad else 2]):
        qmap = MAPS[bits][min(i, 1)]
        codes, absmax = ops.quantize_blockwise(x, qmap, block, "none" if i == 0 else "sqrt", "torch", bits,
                                               row_len=row_len)
        out.append((codes, absmax, qmap))
    return out


HYPER = torch.tensor([0.999, 0.0, 0.1, 0.999, 0.001, 1e-8, -1e-3, 0.05, 1e-9, 2e-9])
HYPER_L2 = torch.tensor([1.0, 0.1, 0.1, 0.999, 0.001, 1e-8, -1e-3, 0.05, 1e-9, 2e-9])  # Adam's L2 decay


def _step(widths, backend, p, g, states, hyper, row_len, maximize, seed):
    device = DEVICE if backend == "triton" else "cpu"
    p = p.to(device)
    inputs = [ops.StepInput(c.to(device), a.to(device), q.to(device), q.to(device)) for c, a, q in states]
    ops.adam8bit_step(p, g.to(device), inputs, hyper, block_size=BLOCK, ratio=True, maximize=maximize,
                      backend=backend, bits=list(widths[: len(states)]), seed=seed, row_len=row_len)
    return p.cpu(), [(s.codes.cpu(), s.absmax.cpu()) for s in inputs]


MIXES = ((6, 2, 4), (4, 4, 4), (8, 8, 8), (2, 2, 2), (8, 2, 6))
DTYPES = ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
          (torch.bfloat16, torch.float32))


STEP_ROW_LENS = ROW_LENS[:4] + (3 * BLOCK + 7,)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("row_len", STEP_ROW_LENS)
@pytest.mark.parametrize("widths", MIXES)
def test_step_on_rows_matches_the_reference(widths, row_len):
    """Each case rotates through param/grad dtypes, amsgrad, maximize, L2 or decoupled decay and seeds (one
    above 2**31, where the kernel takes the seed's int32 bits)."""
    k = MIXES.index(widths) + STEP_ROW_LENS.index(row_len)
    pdtype, gdtype = DTYPES[k % 4]
    amsgrad, maximize = k % 2 == 0, k % 3 == 0
    seed = (None, 12345, 2**31 + 5)[k // 2 % 3]
    rows = 3 if row_len > 1 else 7
    n = rows * row_len
    gen = torch.Generator().manual_seed(n + sum(widths))
    p, g = torch.randn(n, generator=gen).to(pdtype), torch.randn(n, generator=gen).to(gdtype)
    states = row_states(widths, n, row_len, amsgrad, gen)
    hyper = HYPER_L2 if k % 2 else HYPER
    pa, sa = _step(widths, "torch", p, g, states, hyper, row_len, maximize, seed)
    pb, sb = _step(widths, "triton", p, g, states, hyper, row_len, maximize, seed)
    _assert_same(pa, pb)
    for (ca, aa), (cb, ab) in zip(sa, sb):
        assert torch.equal(ca, cb)
        _assert_same(aa, ab)


def test_a_row_step_touches_no_byte_outside_the_codes():
    """Rows of 65 4-bit codes end in a half byte: the kernel writes each row's bytes and nothing past them
    (a guard byte after each tensor stays as it was)."""
    gen = torch.Generator().manual_seed(0)
    states = row_states((4, 4), 3 * 65, 65, False, gen)
    guarded = []
    for c, a, q in states:
        c_big = torch.cat([c, torch.tensor([0xA5], dtype=torch.uint8)]).to(DEVICE)
        a_big = torch.cat([a, torch.tensor([7.0])]).to(DEVICE)
        guarded.append((c_big, a_big, q.to(DEVICE)))
    inputs = [ops.StepInput(c[:-1], a[:-1], q, q) for c, a, q in guarded]
    p = torch.randn(3 * 65, generator=gen).to(DEVICE)
    ops.adam8bit_step(p, torch.randn(3 * 65, generator=gen).to(DEVICE), inputs, HYPER, block_size=BLOCK, ratio=True,
                      backend="triton", bits=4, row_len=65)
    for c, a, _ in guarded:
        assert int(c[-1]) == 0xA5 and float(a[-1]) == 7.0
