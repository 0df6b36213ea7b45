"""The backend axis of the kernel tests: the ``kernel`` fixture, parametrized indirectly by each test
(``tests.kernels.cases.over``), loads the implementation a case runs on and yields its ``ops`` backend name.

``native``: the C kernels as built for this CPU (AVX-512 and VBMI paths where it has them); ``portable``
(x86-64-v2: scalar C only), ``avx2`` (x86-64-v3: the AVX2 path) and ``avx512-no-vbmi`` (skylake-avx512:
16-lane gathers for the codebook): the same C source built with another -march, each from a cache folder of
its own (compiled by the first module that asks for it, loaded from that folder by the next ones), also
``native`` to ``ops``. Where the native build is the AVX2 path already (an AVX2 CPU without AVX-512) the avx2
build would repeat it: skipped. ``triton``: the Triton kernels, on the GPU where there is one, else in
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton).
"""

import os
import platform

import pytest
import torch

from ckptq.kernels import native
from tests.kernels.cases import cpu_flags

# -march of each extra build, and the CPU flags it needs to run here. Each caps the SIMD path (kernels/simd.h)
# below what "native" picks on a wider CPU: scalar C, AVX2, AVX-512 without VBMI.
X86_64_V3 = {"avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "abm"}  # what gcc may use under -march=x86-64-v3
BUILDS = {"portable": ("x86-64-v2", set()), "avx2": ("x86-64-v3", X86_64_V3),
          "avx512-no-vbmi": ("skylake-avx512", {"avx512f", "avx512bw", "avx512dq"})}

_BUILD_CACHES: dict[str, str] = {}  # build -> its cache folder, for the session


def pytest_configure(config):
    config.addinivalue_line("markers", "c_kernels: a case of the C kernels (a C build of the kernel fixture); "
                                       "tools/scripts/gpu_check.sh deselects them with -m 'not c_kernels'")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """Cases that run on a C build are marked ``c_kernels``. Within each module the cases of the other C builds
    run last, build after build (a stable sort; modules keep their order): each build is loaded once per module,
    not once per test function whose cases switch between them."""
    modules: dict = {}
    rank = {name: i for i, name in enumerate(BUILDS, 1)}
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if params.get("kernel", "triton") != "triton":
            item.add_marker(pytest.mark.c_kernels)
    items.sort(key=lambda item: (modules.setdefault(item.path, len(modules)),
                                 rank.get(getattr(getattr(item, "callspec", None), "params", {}).get("kernel"), 0)))


@pytest.fixture(scope="module")
def kernel(request, tmp_path_factory):
    """The backend a case runs on (``request.param``: native, portable, avx2, avx512-no-vbmi or triton), loaded;
    yields its ``ops`` backend name ("native" for every C build)."""
    name = request.param
    if name == "triton":
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton runs here only under TRITON_INTERPRET=1 (set by tests/conftest.py)")
        pytest.importorskip("triton")
        yield "triton"
        return
    if native.library() is None:
        pytest.skip(f"C kernels unavailable: {native.why_unavailable()}")
    if name == "native":
        yield "native"
        return
    march, needs = BUILDS[name]
    if platform.machine() not in ("x86_64", "AMD64") or not needs <= cpu_flags():
        pytest.skip(f"the {name} build needs an x86-64 CPU with {sorted(needs) or 'SSE4.2'}")
    if name == "avx2" and "avx512f" not in cpu_flags():
        pytest.skip("the native build is the AVX2 path on this CPU")
    if name not in _BUILD_CACHES:
        _BUILD_CACHES[name] = str(tmp_path_factory.mktemp(name))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CKPTQ_NATIVE_MARCH", march)
        mp.setenv("CKPTQ_CACHE_DIR", _BUILD_CACHES[name])
        native._load.cache_clear()
        assert native.library() is not None, native.why_unavailable()
        yield "native"
    native._load.cache_clear()


@pytest.fixture
def one_thread():
    """torch on one thread: small torch ops on two threads of a busy machine cost seconds (the C calls of
    test_step_group.py set their own thread count inside)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
