"""ckptq.ops: the one declaration of each operation. Validation happens here, once, with UsageErrors
that say what to fix; backend choice happens here; DTensor parameters are stepped on their local shards.
(Bit-for-bit agreement of the backends: test_codec.py, tests/kernels/test_quantize.py, test_step*.py.)"""

import pytest
import torch

from ckptq.optim import adam
from ckptq.codec import ops, policy, quant
from ckptq.errors import UsageError
from ckptq.kernels import backend_native, backend_torch

CPU_BACKENDS = ["torch"] + (["native"] if backend_native.available() else [])


def _moments(n: int, block: int = 256, gen_seed: int = 0):
    gen = torch.Generator().manual_seed(gen_seed)
    v_dense = torch.rand(n, generator=gen) * 1e-4
    v = quant.quantize_state(v_dense, "exp_avg_sq", block)
    m = quant.quantize_ratio(torch.randn(n, generator=gen) * 1e-3, v_dense, 1e-8, block)
    return m, v


def _inputs(m: dict, v: dict):
    return [ops.StepInput(q["codes"], q["absmax"], q["qmap"], q["qmap"]) for q in (m, v)]


def _hyper10():
    return torch.cat((adam.hyper_tensor(1e-2, 0.9, 0.999, 1e-8, 0.0, 2, True), torch.tensor([1e-8, 1e-8])))


def test_backends_are_declared_in_one_place():
    assert ops.BACKENDS == ("auto", "torch", "native", "triton")
    with pytest.raises(UsageError, match="not one of auto, torch, native, triton"):
        ops.quantize_blockwise(torch.ones(8), policy.RATIO_POLICY.qmap(), backend="cuda")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_float64_input_gives_the_codes_of_its_fp32_rounding(backend):
    """The C kernels read fp32/bf16/fp16; other float dtypes take the reference, which rounds to fp32."""
    x = torch.randn(5000, dtype=torch.float64) * 1e-3
    qmap = policy.POLICIES["exp_avg"].qmap()
    got = ops.quantize_blockwise(x, qmap, 256, "none", backend)
    want = backend_torch.reference_codes(x.float(), ops.midpoints(qmap), 256)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_non_float_and_bad_bits_are_usage_errors():
    qmap = policy.RATIO_POLICY.qmap()
    with pytest.raises(UsageError, match="floating-point"):
        ops.quantize_blockwise(torch.ones(8, dtype=torch.int64), qmap)
    with pytest.raises(UsageError, match="3-bit codes are not supported; use bits=8 or 6 or 4 or 2"):
        ops.quantize_blockwise(torch.ones(8), qmap, bits=3)
    with pytest.raises(UsageError, match="codebook must be a float tensor of 16 entries"):
        ops.quantize_blockwise(torch.ones(8), qmap, bits=4)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_step_refuses_states_that_do_not_fit_the_param(backend):
    """A state of another size would let a kernel read or write past the end: refused up front,
    with nothing changed."""
    m, v = _moments(1000)
    p = torch.randn(999)
    before = m["codes"].clone()
    with pytest.raises(UsageError, match="holds 1000 code bytes .* 999 elements"):
        ops.adam8bit_step(p, torch.randn(999), _inputs(m, v), _hyper10(), block_size=256, ratio=True, backend=backend)
    with pytest.raises(UsageError, match="block size 100"):
        ops.adam8bit_step(p, torch.randn(999), _inputs(m, v), _hyper10(), block_size=100, ratio=True, backend=backend)
    with pytest.raises(UsageError, match="hyper must hold 10"):
        ops.adam8bit_step(torch.randn(1000), torch.randn(1000), _inputs(m, v), _hyper10()[:8], block_size=256,
                          ratio=True, backend=backend)
    with pytest.raises(UsageError, match="does not fit the parameter"):
        ops.adam8bit_step(torch.randn(1000), torch.randn(10), _inputs(m, v), _hyper10(), block_size=256, ratio=True)
    assert torch.equal(m["codes"], before)


class _Odd(torch.Tensor):
    pass


def test_tensor_subclasses_other_than_dtensor_are_refused():
    m, v = _moments(1000)
    p = torch.randn(1000).as_subclass(_Odd)
    with pytest.raises(UsageError, match="_Odd; ckptq's kernels take torch.Tensor, Parameter or DTensor"):
        ops.adam8bit_step(p, torch.randn(1000), _inputs(m, v), _hyper10(), block_size=256, ratio=True)


@pytest.fixture
def one_rank_mesh():
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_dtensor_params_step_on_their_local_shard(one_rank_mesh, backend):
    """FSDP2 parameters are DTensors: the step runs on the local shard, never on the wrapper's storage,
    and gives the bits of the same step on a plain tensor."""
    from torch.distributed.tensor import Shard, distribute_tensor

    p0, g = torch.randn(64, 80), torch.randn(64, 80) * 1e-2
    (m1, v1), (m2, v2) = _moments(64 * 80), _moments(64 * 80)
    dp = torch.nn.Parameter(distribute_tensor(p0.clone(), one_rank_mesh, [Shard(0)]))
    dg = distribute_tensor(g.clone(), one_rank_mesh, [Shard(0)])
    plain = p0.clone()
    h = _hyper10()
    ops.adam8bit_step(dp, dg, _inputs(m1, v1), h, block_size=256, ratio=True, backend=backend)
    ops.adam8bit_step(plain, g, _inputs(m2, v2), h, block_size=256, ratio=True, backend=backend)
    assert torch.equal(dp.to_local().detach(), plain)
    assert not torch.equal(plain, p0)
    assert torch.equal(m1["codes"], m2["codes"]) and torch.equal(v1["absmax"], v2["absmax"])
