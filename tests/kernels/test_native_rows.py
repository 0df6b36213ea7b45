"""The C kernels on the row layout (``ckptq/kernels/contract.py``, "Rows") against the PyTorch reference,
bit for bit: quantize, dequantize and the fused step, at row lengths that are and are not multiples of
the block (1, block - 1, block + 1, 3 * block + 7, 201, 577...), block sizes 64..4096, every code width
and width mix of the step, fp32/bf16/fp16 params and grads, amsgrad, maximize, seeded and nearest
rounding. A subset runs against the other builds of tests/kernels/test_native.py too (AVX-512 without VBMI,
scalar C only).
"""

import pytest
import torch

from ckptq.codec import ops, policy
from ckptq.kernels import backend_native, backend_torch
from ckptq.kernels.contract import StepFlags, StepState, is_flat, layout_blocks, layout_bytes
from tests.kernels.test_native import _assert_same, build  # noqa: F401 (the build fixture)

pytestmark = pytest.mark.skipif(not backend_native.available(), reason="C kernels unavailable")


@pytest.fixture(autouse=True)
def one_thread():
    """One thread: small torch ops on two threads of a busy machine cost seconds (tests/kernels/test_native_group.py
    runs the C kernels on two)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

# (rows, row_len, block): rows that are not whole blocks (short last blocks of every length class: 1,
# block - 1, a vector's worth and a remainder, ...), plus one that is (the flat layout, same bits)
ROW_CASES = [(5, 1, 64), (3, 63, 64), (3, 65, 64), (2, 3 * 64 + 7, 64), (4, 201, 64), (3, 577, 256), (2, 255, 256),
             (3, 300, 128), (2, 1023, 512), (2, 2049, 1024), (2, 4095, 2048), (2, 4097, 4096), (2, 3 * 4096 + 7, 4096),
             (3, 512, 256)]
CASE_IDS = [f"{r}x{c}-b{b}" for r, c, b in ROW_CASES]

# codebooks per width: signed ones for the first moment (ratio codes), unsigned for sqrt(v) and sqrt(vmax)
SIGNED = {8: policy.ratio_policy(8).qmap(), 6: policy.ratio_policy(6).qmap(), 4: policy.ratio_policy(4).qmap(),
          2: torch.tensor([-1.0, -0.3, 0.0, 1.0])}
UNSIGNED = {8: policy.policy_for("exp_avg_sq", 8).qmap(), 6: torch.linspace(0, 1, 64) ** 2,
            4: policy.policy_for("exp_avg_sq", 4).qmap(), 2: policy.policy_for("exp_avg_sq", 2).qmap()}
# the step's code widths per moment (exp_avg, exp_avg_sq[, max_exp_avg_sq])
MIXES = [(8, 8), (6, 2), (4, 4), (2, 2), (8, 4), (8, 8, 8), (6, 2, 4), (4, 4, 4), (2, 2, 2)]
DTYPES = [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.float16,) * 2, (torch.bfloat16, torch.float32)]


def _values(n: int, signed: bool, gen: torch.Generator) -> torch.Tensor:
    """Values over many decades, zeros in places (an all-zero short block when rows are short)."""
    x = torch.randn(n, generator=gen) * 10.0 ** torch.empty(n).uniform_(-6, 1, generator=gen)
    x[: min(n, 70)] = 0.0
    return x if signed else x.abs()


def quantize_both(rows: int, row_len: int, block: int, bits: int, dtype: torch.dtype) -> None:
    """Quantize in rows with the reference and the C kernels, decode each: equal codes, scales, values."""
    n, signed = rows * row_len, bits in (8, 4)  # signed codebooks at two widths, sqrt + unsigned at the others
    gen = torch.Generator().manual_seed(rows * row_len + block + bits)
    x = _values(n, signed, gen).to(dtype)
    qmap, sqrt = (SIGNED[bits], False) if signed else (UNSIGNED[bits], True)
    out = []
    for impl in (backend_torch, backend_native):
        codes = torch.full((layout_bytes(n, row_len, bits),), 0xA5, dtype=torch.uint8)  # no byte left unwritten
        absmax = torch.full((layout_blocks(n, row_len, block),), 7.0)
        impl.quantize(x, ops.midpoints(qmap), block, sqrt, codes, absmax, bits, row_len)
        decoded = torch.full((n,), 7.0)
        impl.dequantize(codes, absmax, qmap, block, sqrt, decoded, False, bits, row_len)
        out.append((codes, absmax, decoded))
    (c1, a1, d1), (c2, a2, d2) = out
    assert torch.equal(c1, c2)
    _assert_same(a1, a2)
    _assert_same(d1, d2)


@pytest.mark.parametrize("rows,row_len,block", ROW_CASES, ids=CASE_IDS)
@pytest.mark.parametrize("bits", (8, 6, 4, 2))
def test_quantize_and_dequantize_rows(rows, row_len, block, bits):
    dtype = (torch.float32, torch.bfloat16, torch.float16)[(ROW_CASES.index((rows, row_len, block)) + bits) % 3]
    quantize_both(rows, row_len, block, bits, dtype)


def _states(n: int, row_len: int, block: int, mix: tuple, gen: torch.Generator) -> tuple[StepState, ...]:
    """exp_avg (ratio codes), exp_avg_sq and max_exp_avg_sq (sqrt) quantized in rows by the reference."""
    states = []
    for k, bits in enumerate(mix):
        qmap = SIGNED[bits] if k == 0 else UNSIGNED[bits]
        x = _values(n, k == 0, gen) * (1e-3 if k == 0 else 1e-6)
        codes = torch.empty(layout_bytes(n, row_len, bits), dtype=torch.uint8)
        absmax = torch.empty(layout_blocks(n, row_len, block))
        backend_torch.quantize(x, ops.midpoints(qmap), block, k > 0, codes, absmax, bits, row_len)
        states.append(StepState(codes, absmax, qmap, ops.midpoints(qmap), qmap, bits))
    return tuple(states)


def _hyper(step: int, decoupled: bool) -> torch.Tensor:
    lr, wd, b1, b2, eps = 1e-2, 0.1, 0.9, 0.999, 1e-8
    return torch.tensor([1 - lr * wd if decoupled else 1.0, 0.0 if decoupled else wd, 1 - b1, b2, 1 - b2, eps,
                         -lr / (1 - b1**step), (1 - b2**step) ** 0.5, eps, 2 * eps], dtype=torch.float32)


def _clone(states):
    return tuple(s._replace(codes=s.codes.clone(), absmax=s.absmax.clone()) for s in states)


def step_both(p0, g, states, flags: StepFlags, steps: int = 2):
    """``steps`` steps of the reference and of the C kernels from the same start: their (p, states)."""
    results = []
    for impl in (backend_torch, backend_native):
        p, s = p0.clone(), _clone(states)
        for t in range(1, steps + 1):
            impl.adam_step(p, g * t, s, _hyper(t + 3, decoupled=t % 2 == 1), flags)
        results.append((p, s))
    return results


def assert_same_step(results) -> None:
    (pa, sa), (pb, sb) = results
    _assert_same(pa, pb)
    for k, (a, b) in enumerate(zip(sa, sb)):
        assert torch.equal(a.codes, b.codes), f"moment {k}: codes differ"
        _assert_same(a.absmax, b.absmax)


def step_rows(rows: int, row_len: int, block: int, mix: tuple, index: int) -> None:
    """Two steps (nearest, fp32) and two more (seeded, the dtypes ``index`` picks, maximize every other
    index) of the reference and the C kernels from the same start: equal params, codes and scales."""
    n = rows * row_len
    assert is_flat(n, row_len, block) == (row_len % block == 0)
    for variant, (pdtype, gdtype) in enumerate((DTYPES[0], DTYPES[index % 4])):
        gen = torch.Generator().manual_seed(index * 10 + variant)
        p0 = (torch.randn(n, generator=gen) * 10.0 ** torch.empty(n).uniform_(-6, 1, generator=gen)).to(pdtype)
        g = (torch.randn(n, generator=gen) * 1e-2).to(gdtype)
        g[::7] = 0.0
        seed = None if variant == 0 else 0xC0FFEE + index
        flags = StepFlags(block, True, variant == 1 and index % 2 == 0, seed, row_len)
        assert_same_step(step_both(p0, g, _states(n, row_len, block, mix, gen), flags))


# every row case with three width mixes, every mix with several row cases
STEP_CASES = [(case, MIXES[(i + k * 3) % len(MIXES)]) for i, case in enumerate(ROW_CASES) for k in range(3)]
STEP_IDS = [f"{r}x{c}-b{b}-{'+'.join(map(str, m))}" for (r, c, b), m in STEP_CASES]


@pytest.mark.parametrize("case,mix", STEP_CASES, ids=STEP_IDS)
def test_step_rows(case, mix):
    step_rows(*case, mix, STEP_CASES.index((case, mix)))


@pytest.mark.parametrize("mix", MIXES, ids=["+".join(map(str, m)) for m in MIXES])
def test_other_builds_agree(mix, build):
    """The scalar-only and the AVX-512-without-VBMI builds (and this CPU's) on irregular rows: each mix's
    step, each of its widths' quantize and dequantize."""
    step_rows(3, 201, 64, mix, MIXES.index(mix))
    for bits in set(mix):
        quantize_both(3, 577, 256, bits, torch.bfloat16)


@pytest.mark.parametrize("row_len,block", ((201, 64), (4097, 4096)))
def test_step_rows_with_nan_inf_and_huge_gradients(row_len, block):
    """NaN, Inf and overflowing gradients in short last blocks of rows (their scales become NaN / inf)."""
    n, gen = 3 * row_len, torch.Generator().manual_seed(row_len)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3
    g[5], g[row_len + row_len - 3], g[-1] = float("nan"), float("inf"), 1e20
    flags = StepFlags(block, True, False, None, row_len)
    assert_same_step(step_both(p0, g, _states(n, row_len, block, (8, 8, 8), gen), flags))
