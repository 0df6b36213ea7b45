"""The C CPU kernels (ckptq/kernels/cpu_kernels.c) against their PyTorch references, bit for bit.

quantize/dequantize against ckptq.ops' torch backend (which tests/codec/test_codec.py checks against the
plain rounding contract), the fused Adam step against backend_torch.adam_step (backend="torch"), on irregular
sizes that span several chunks and end in a short block, every input dtype, special values, and every
bucket edge of the code table. Also: the build cache, and the fallback to PyTorch without a compiler.
"""

import platform

import pytest
import torch

from ckptq.codec import codebooks, ops, policy
from ckptq.kernels import backend_torch, lut
from ckptq.errors import UsageError
from ckptq.kernels import native
from ckptq.optim import Adam8bit, AdamW8bit

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"C kernels unavailable: {native.why_unavailable()}")

CODEBOOKS = {
    "dynamic-signed": codebooks.dynamic_map(True),
    "dynamic-unsigned": codebooks.dynamic_map(False),
    **{name: pol.qmap() for name, pol in (("exp_avg", policy.POLICIES["exp_avg"]), ("exp_avg_sq", policy.POLICIES["exp_avg_sq"]),
                                          ("ratio", policy.RATIO_POLICY))},
}
# several chunks of the C path (at least 64K elements each), and a short last block
SIZES = (1, 63, 4097, 3 * 65536 + 77)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {w for line in f if line.startswith("flags") for w in line.split(":", 1)[1].split()}
    except OSError:
        return set()


# -march of each extra build, and the CPU flags it needs to run here. Each caps the SIMD path (kernels/simd.h)
# below what "native" picks on a wider CPU: scalar C, AVX2, AVX-512 without VBMI.
X86_64_V3 = {"avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "abm"}  # what gcc may use under -march=x86-64-v3
BUILDS = {"portable": ("x86-64-v2", set()), "avx2": ("x86-64-v3", X86_64_V3),
          "avx512-no-vbmi": ("skylake-avx512", {"avx512f", "avx512bw", "avx512dq"})}


_BUILD_CACHES: dict[str, str] = {}  # build -> its cache folder, for the session


@pytest.fixture(scope="module", params=["native", "portable", "avx2", "avx512-no-vbmi"])
def build(request, tmp_path_factory):
    """Each equality test runs against the build for this CPU (AVX-512 and VBMI paths where it has them),
    a portable x86-64-v2 build (scalar C only), an x86-64-v3 build (the AVX2 path) and an AVX-512 build
    without VBMI (16-lane gathers for the codebook), each from a cache folder of its own: compiled by the
    first module that asks for it, loaded from that folder by the next ones. Where the native build is
    the AVX2 path already (an AVX2 CPU without AVX-512), the avx2 build would repeat it: skipped."""
    if request.param != "native":
        march, needs = BUILDS[request.param]
        if platform.machine() not in ("x86_64", "AMD64") or not needs <= _cpu_flags():
            pytest.skip(f"the {request.param} build needs an x86-64 CPU with {sorted(needs) or 'SSE4.2'}")
        if request.param == "avx2" and "avx512f" not in _cpu_flags():
            pytest.skip("the native build is the AVX2 path on this CPU")
        if request.param not in _BUILD_CACHES:
            _BUILD_CACHES[request.param] = str(tmp_path_factory.mktemp(request.param))
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("CKPTQ_NATIVE_MARCH", march)
            mp.setenv("CKPTQ_CACHE_DIR", _BUILD_CACHES[request.param])
            native._load.cache_clear()
            assert native.library() is not None, native.why_unavailable()
            yield request.param
        native._load.cache_clear()
    else:
        yield request.param


def _both(fn):
    return fn("torch"), fn("native")


def _assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal bits, except that any NaN equals any NaN (payloads are not part of the contract)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(b))
    assert torch.equal(a[~nan], b[~nan])
    if a.is_floating_point():  # -0.0 vs +0.0 too
        assert torch.equal(torch.signbit(a[~nan]), torch.signbit(b[~nan]))


def _special(n: int, signed: bool, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, generator=gen) * 10.0 ** torch.empty(n).uniform_(-30, 3, generator=gen)
    x = x if signed else x.abs()
    x[:64] = 0.0  # an all-zero block
    x[64:80] = -0.0 if signed else 0.0
    x[80:90] = 1e-42  # subnormal
    if n > 300:
        x[200] = float("nan")
        x[290] = float("inf")
    return x


def bucket_edges(qmap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, the codebook's midpoints): both ends of every 2^16-float bucket in [-1, 1] (>= 0 for an unsigned
    codebook), every midpoint +-1 ulp, NaN and +-0, 63 to a block of 64 after a 1.0 that makes absmax 1."""
    t = ops.midpoints(qmap)
    lo, hi = lut.bucket_bounds()
    y = torch.cat([lo, hi, t, torch.nextafter(t, torch.tensor(2.0)), torch.nextafter(t, torch.tensor(-2.0)),
                   torch.tensor([float("nan"), -0.0, 0.0])])
    y = y[~(y.abs() > 1)]  # keeps NaN
    if bool((qmap >= 0).all()):
        y = y[~(y < 0)]
    n_blocks = -(-y.numel() // 63)
    body = torch.zeros(n_blocks * 63)
    body[: y.numel()] = y
    return torch.cat([torch.ones(n_blocks, 1), body.view(n_blocks, 63)], dim=1).view(-1), t


@pytest.mark.parametrize("name", sorted(CODEBOOKS))
def test_code_table_equals_searchsorted_on_every_bucket_edge(name, build):
    """Both ends of every 2^16-float bucket in [-1, 1], every threshold +-1 ulp, and NaN: each value
    sits in a block whose absmax is exactly 1, so y = x and the table meets every edge case."""
    qmap = CODEBOOKS[name]
    x, t = bucket_edges(qmap)
    codes, absmax = ops.quantize_blockwise(x, qmap, 64, backend="native")
    ref, _ = backend_torch.reference_codes(x, t, 64)
    assert torch.equal(codes, ref)
    assert torch.equal(absmax.isnan(), torch.isnan(x.view(-1, 64)).any(1))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("block", (64, 256, 4096))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("signed,transform", ((True, "none"), (False, "sqrt"), (False, "none")))
def test_quantize_and_dequantize_match_the_torch_path(n, block, dtype, signed, transform, build):
    gen = torch.Generator().manual_seed(n + block)
    x = _special(n, signed, gen).to(dtype)
    qmap = codebooks.dynamic_map(signed)
    (c1, a1), (c2, a2) = _both(lambda b: ops.quantize_blockwise(x, qmap, block, transform, b))
    assert torch.equal(c1, c2)
    _assert_same(a1, a2)
    d1, d2 = _both(lambda b: ops.dequantize_blockwise(c1, a1, qmap, block, transform, b))
    _assert_same(d1, d2)
    out = torch.full((n,), 7.0)
    d3 = ops.dequantize_blockwise(c1, a1, qmap, block, transform, "native", out=out)
    assert d3.data_ptr() == out.data_ptr()
    _assert_same(d1, d3)


def _run(cls, p0: torch.Tensor, grads, backend: str, **kw):
    p = torch.nn.Parameter(p0.clone())
    if grads[0].dtype != p.dtype:
        p.grad_dtype = grads[0].dtype  # e.g. a bf16 param with an fp32 gradient (master-grad setups)
    opt = cls([p], lr=1e-2, backend=backend, **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach(), opt.state[p]


@pytest.mark.parametrize("n", SIZES[1:] + (3 * 256 + 48,))  # the last: a 48-element block (16-lane loop)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16, "bf16-param-fp32-grad"))
@pytest.mark.parametrize("cls,kw", (
    (AdamW8bit, {}),
    (Adam8bit, {"weight_decay": 0.1}),
    (AdamW8bit, {"amsgrad": True, "maximize": True, "block_size": 64}),
    (AdamW8bit, {"block_size": 4096, "betas": (0.8, 0.95), "eps": 1e-6}),
))
def test_adam_step_matches_the_torch_path(n, dtype, cls, kw, build):
    """Three steps (one with zero gradients in places) from the same start: parameters, codes and scales equal."""
    gen = torch.Generator().manual_seed(n)
    scale = 10.0 ** torch.empty(n).uniform_(-7, 2, generator=gen)  # fp16 subnormals up to large values
    pdtype, gdtype = (torch.bfloat16, torch.float32) if dtype == "bf16-param-fp32-grad" else (dtype, dtype)
    p0 = (torch.randn(n, generator=gen) * scale).to(pdtype)
    grads = [(torch.randn(n, generator=gen) * 1e-2).to(gdtype) for _ in range(3)]
    grads[1][::7] = 0
    (pa, sa), (pb, sb) = _both(lambda b: _run(cls, p0, grads, b, min_size=64, **kw))
    _assert_same(pa, pb)
    for key, q in sa.items():
        if isinstance(q, dict):
            assert torch.equal(q["codes"], sb[key]["codes"]), key
            _assert_same(q["absmax"], sb[key]["absmax"])
            assert q["transform"] == sb[key]["transform"] and q.get("eps") == sb[key].get("eps")


@pytest.mark.parametrize("n,block", ((5000, 256), (202, 64)))
def test_adam_step_with_nan_and_inf_gradients_matches(n, block, build):
    """NaN and Inf gradients, and huge ones whose v overflows to +inf in a short last block (whose
    scale then is +inf: the PyTorch path must not let padding turn it into NaN)."""
    gen = torch.Generator().manual_seed(3)
    p0 = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 1e-3
    g[10], g[n // 2] = float("nan"), float("inf")
    g[-10:] = 1e20
    (pa, sa), (pb, sb) = _both(lambda b: _run(AdamW8bit, p0, [g, g * 0.5], b, min_size=64, amsgrad=True,
                                              block_size=block))
    _assert_same(pa, pb)
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        assert torch.equal(sa[key]["codes"], sb[key]["codes"])
        _assert_same(sa[key]["absmax"], sb[key]["absmax"])


@pytest.fixture
def fresh_build(tmp_path, monkeypatch):
    """An empty kernel cache; the loader's memo is reset before and after."""
    monkeypatch.setenv("CKPTQ_CACHE_DIR", str(tmp_path))
    native._load.cache_clear()
    yield tmp_path
    monkeypatch.undo()
    native._load.cache_clear()


def test_the_build_key_and_the_wheel_cover_every_file_the_kernels_include():
    """native.HEADERS lists every file cpu_kernels.c includes, directly or not (a header left out would
    neither change the cache key when edited nor ship in the wheel: package-data takes kernels/*.h)."""
    import re

    folder = native.SOURCE.parent
    seen, todo = set(), [native.SOURCE.name]
    while todo:
        name = todo.pop()
        for inc in re.findall(r'^\s*#\s*include\s+"([^"]+)"', (folder / name).read_text(), re.M):
            if inc not in seen:
                seen.add(inc)
                todo.append(inc)
    assert seen == {h.name for h in native.HEADERS}
    assert all(h.parent == folder and h.suffix == ".h" for h in native.HEADERS)


def test_build_goes_to_the_cache_once(fresh_build):
    """One library, its SHA-256 record and the build lock; none writable by others; loaded, not rebuilt."""
    import hashlib

    assert native.library() is not None
    (lib,) = fresh_build.glob("cpu_kernels-*.so")
    assert sorted(p.name for p in fresh_build.iterdir()) == sorted([lib.name, lib.name + ".sha256", "build.lock"])
    assert all(p.stat().st_mode & 0o022 == 0 for p in fresh_build.iterdir())
    assert (fresh_build / (lib.name + ".sha256")).read_text().strip() == hashlib.sha256(lib.read_bytes()).hexdigest()
    stamp = lib.stat().st_mtime_ns
    native._load.cache_clear()
    assert native.library() is not None
    assert lib.stat().st_mtime_ns == stamp  # loaded, not rebuilt


def test_without_a_compiler_the_torch_path_runs_with_one_warning(fresh_build, monkeypatch):
    monkeypatch.setenv("CC", "ckptq-no-such-compiler")
    x = torch.randn(10000)
    qmap = codebooks.dynamic_map(True)
    with pytest.warns(RuntimeWarning, match="no C compiler"):
        codes, absmax = ops.quantize_blockwise(x, qmap)
    assert ops.resolve_backend("auto", x.device) == "torch"
    assert torch.equal(codes, ops.quantize_blockwise(x, qmap, backend="torch")[0])
    with pytest.raises(UsageError, match="backend 'native' is unavailable: no C compiler"):
        ops.quantize_blockwise(x, qmap, backend="native")
    assert list(fresh_build.iterdir()) == []


def test_ckptq_native_0_turns_it_off(monkeypatch):
    monkeypatch.setenv("CKPTQ_NATIVE", "0")
    assert native.library() is None
    assert ops.resolve_backend("auto", torch.device("cpu")) == "torch"
    with pytest.raises(UsageError, match="CKPTQ_NATIVE=0"):
        ops.resolve_backend("native", torch.device("cpu"))


def test_cc_with_arguments_and_an_unreadable_build(fresh_build, monkeypatch):
    """CC is split like a shell would ("ccache gcc"); a cached build this user cannot load is rebuilt."""
    monkeypatch.setenv("CC", "env cc")
    target = native.build_path(native._compiler())
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(b"not a shared object")  # what dlopen makes of a build it cannot read
    assert native.library() is not None, native.why_unavailable()
    assert target.stat().st_size > 1000
    x = torch.randn(3000)
    qmap = codebooks.dynamic_map(True)
    assert torch.equal(*(ops.quantize_blockwise(x, qmap, backend=b)[0] for b in ("torch", "native")))


def test_malformed_states_never_reach_the_kernel():
    """What the C kernel would read or write out of bounds is refused before: a short absmax or an
    unsupported block size in a loaded state dict, a short absmax / wrong codes dtype / short codebook
    in dequantize."""
    from ckptq.errors import StateMismatchError

    p = torch.nn.Parameter(torch.randn(5000))
    opt = AdamW8bit([p], min_size=64)
    p.grad = torch.randn(5000)
    opt.step()
    good = opt.state_dict()
    for key, bad in (("absmax", lambda q: q["absmax"].reshape(-1)[:3]), ("block_size", lambda q: 8192)):
        sd = {"state": {0: {**good["state"][0], "exp_avg_sq": {**good["state"][0]["exp_avg_sq"], key: bad(good["state"][0]["exp_avg_sq"])}}},
              "param_groups": good["param_groups"]}
        with pytest.raises(StateMismatchError, match="malformed"):
            AdamW8bit([p], min_size=64).load_state_dict(sd)
    q = good["state"][0]["exp_avg_sq"]
    for args, match in (((q["codes"], q["absmax"].reshape(-1)[:3], q["qmap"]), "absmax"),
                        ((q["codes"].int(), q["absmax"], q["qmap"]), "uint8"),
                        ((q["codes"], q["absmax"], q["qmap"][:16]), "codebook")):
        for backend in ("torch", "native"):
            with pytest.raises(UsageError, match=match):
                ops.dequantize_blockwise(*args, 256, "sqrt", backend)
