"""Where the C kernels are loaded from, and what is checked first (ckptq/kernels/native_build.py).

A library planted by another user in a cache folder they can write is never loaded (its constructor
would run inside this process); folders are created private under umask 000; a truncated library is
rebuilt, never dlopened (that is SIGBUS); one without the kernels is rebuilt once, then PyTorch with
one warning; six processes starting at once compile once; CPUs the compiler resolves -march=native
differently for get different builds. Also: the build key and the wheel cover every file the kernels include,
the build cache, CC with arguments, and the fallback to PyTorch without a compiler or with CKPTQ_NATIVE=0.

ckptq builds through a wrapper (``WRAPPER``) around the system C compiler. The first build of each command
line in a run is the compiler's; the wrapper hands each later build of the same command line (but for its
-o path) the same bytes, as ccache would, so that a test costs a file copy where a compile costs ~15 s.
ckptq's own build path runs every time: the compiler call (logged, and counted by the tests), the temporary
file, the hash record, the rename, the lock.
"""

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

from ckptq.codec import codebooks, ops
from ckptq.errors import UsageError
from ckptq.kernels import native

CC = shutil.which("cc")
pytestmark = pytest.mark.skipif(CC is None or os.name != "posix", reason="needs a C compiler (cc) on POSIX")

# A compiler wrapper: logs each compile (the call with -shared) to $CKQ_TEST_LOG, and can pretend to run
# on another CPU ($CKQ_TEST_MARCH replaces -march=native) or compile another source ($CKQ_TEST_STUB). With
# $CKQ_TEST_MEMO, a compile whose command line (less its -o path) it has run before copies that output.
WRAPPER = """#!/bin/bash
args=(); out=""; prev=""; shared=""
for a in "$@"; do
  [ "$a" = -shared ] && shared=1 && [ -n "$CKQ_TEST_LOG" ] && echo "$$ $*" >> "$CKQ_TEST_LOG"
  [ "$a" = -march=native ] && [ -n "$CKQ_TEST_MARCH" ] && a="-march=$CKQ_TEST_MARCH"
  [ "${a##*/}" = cpu_kernels.c ] && [ -n "$CKQ_TEST_STUB" ] && a="$CKQ_TEST_STUB"
  [ "$prev" = -o ] && out="$a"
  prev="$a"
  args+=("$a")
done
if [ -n "$shared" ] && [ -n "$out" ] && [ -n "$CKQ_TEST_MEMO" ]; then
  key=$(printf '%s\\n' "${args[@]}" | grep -vxF -- "$out" | sha256sum | cut -c1-40)
  [ -f "$CKQ_TEST_MEMO/$key.so" ] && exec cp "$CKQ_TEST_MEMO/$key.so" "$out"
  {CC} "${args[@]}" || exit $?
  cp "$out" "$CKQ_TEST_MEMO/.$key.$$" && mv "$CKQ_TEST_MEMO/.$key.$$" "$CKQ_TEST_MEMO/$key.so"
  exit 0
fi
exec {CC} "${args[@]}"
"""
# What a local attacker plants: the kernel symbols, and a constructor that leaves a marker.
PLANTED = """#include <stdio.h>
__attribute__((constructor)) static void planted(void) { FILE *f = fopen(MARKER, "w"); if (f) fclose(f); }
int ckq_quantize(void) { return 0; }
int ckq_dequantize(void) { return 0; }
int ckq_adam_step_group(void) { return 0; }
int ckq_adam_dense_group(void) { return 0; }
"""
STUB = "int ckq_quantize(void) { return 0; }\n"  # a library without the other kernels


@pytest.fixture(scope="module")
def memo(tmp_path_factory) -> Path:
    """The wrapper's outputs by command line, for the module."""
    return tmp_path_factory.mktemp("cc-memo")


def _use_wrapper(folder: Path, memo: Path, monkeypatch) -> None:
    """``WRAPPER`` written to ``folder`` as $CC, its outputs kept in ``memo``."""
    wrapper = folder / "cc-wrapper"
    wrapper.write_text(WRAPPER.replace("{CC}", CC))
    wrapper.chmod(0o700)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setenv("CKQ_TEST_MEMO", str(memo))


@pytest.fixture
def env(tmp_path, monkeypatch, memo):
    """An empty cache folder (not created yet), a private temp folder, the wrapper as CC, and the
    loader's memo reset before and after."""
    _use_wrapper(tmp_path, memo, monkeypatch)
    tmp = tmp_path / "tmp"
    tmp.mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setenv("CKPTQ_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CKQ_TEST_LOG", str(tmp_path / "compiles.log"))
    native._load.cache_clear()
    yield tmp_path
    monkeypatch.undo()
    native._load.cache_clear()


def _compiles(env: Path) -> int:
    log = env / "compiles.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def _compile(src: str, out: Path, *flags: str) -> Path:
    c = out.with_suffix(".c")
    c.write_text(src)
    subprocess.run([CC, "-shared", "-fPIC", *flags, "-o", str(out), str(c)], check=True, capture_output=True)
    return out


def _record(lib: Path) -> None:
    """The hash record an attacker who can write the folder writes too."""
    lib.with_name(lib.name + ".sha256").write_text(hashlib.sha256(lib.read_bytes()).hexdigest() + "\n")


def _native_matches_torch() -> bool:
    x = torch.randn(5000, generator=torch.Generator().manual_seed(0))
    qmap = codebooks.dynamic_map(True)
    return torch.equal(*(ops.quantize_blockwise(x, qmap, backend=b)[0] for b in ("torch", "native")))


def _plant(folder: Path, marker: Path) -> Path:
    """The planted library, with a matching record, at the very path the loader builds to."""
    target = folder / native._build_name(native._compiler())
    _compile(PLANTED, target, f'-DMARKER="{marker}"')
    _record(target)
    return target


def _shared(env: Path, how: str) -> Path:
    """A cache folder someone else can write into, one of four ways."""
    cache = env / "cache"
    if how == "writable parent":
        (env / "shared").mkdir(mode=0o777)
        os.chmod(env / "shared", 0o777)
        cache = env / "shared" / "cache"
    cache.mkdir(mode=0o700)
    if how == "other owner":
        os.chown(cache, 65534, 65534)
    os.chmod(cache, {"group-writable": 0o770, "world-writable": 0o777}.get(how, 0o755 if how == "other owner" else 0o700))
    return cache


@pytest.mark.parametrize("how", ["group-writable", "world-writable", "writable parent", "other owner"])
def test_a_library_planted_in_a_shared_cache_is_never_loaded(env, monkeypatch, how):
    if how == "other owner" and os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    cache = _shared(env, how)
    monkeypatch.setenv("CKPTQ_CACHE_DIR", str(cache))
    marker = env / "constructor-ran"
    _plant(cache, marker)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lib = native.library()
    assert not marker.exists()  # the planted constructor never ran
    assert lib is not None, native.why_unavailable()
    assert [str(w.message) for w in caught if "ckptq" in str(w.message)] == [str(caught[0].message)]
    assert "C kernel cache not used" in str(caught[0].message) and "\n" not in str(caught[0].message)
    assert _native_matches_torch()  # the private build, not the planted no-op kernels
    assert list((env / "tmp").iterdir()) == []  # the private build folder is gone again


def test_a_symlinked_library_in_a_private_cache_is_replaced_not_followed(env):
    cache = env / "cache"
    cache.mkdir(mode=0o700)
    marker = env / "constructor-ran"
    planted = _compile(PLANTED, env / "elsewhere.so", f'-DMARKER="{marker}"')
    target = cache / native._build_name(native._compiler())
    target.symlink_to(planted)
    _record(planted)
    (cache / (target.name + ".sha256")).write_text((env / "elsewhere.so.sha256").read_text())
    assert native.library() is not None, native.why_unavailable()
    assert not marker.exists()
    assert not target.is_symlink() and _native_matches_torch()


def test_first_use_under_umask_000_creates_private_folders(env, monkeypatch):
    home = env / "home"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("CKPTQ_CACHE_DIR")
    old = os.umask(0)
    try:
        lib = native.library()
    finally:
        os.umask(old)
    assert lib is not None, native.why_unavailable()
    for folder in (home / ".cache", home / ".cache" / "ckptq"):
        assert folder.stat().st_mode & 0o777 == 0o700, folder
    assert all(p.stat().st_mode & 0o022 == 0 for p in (home / ".cache" / "ckptq").iterdir())


def _child(code: str, env_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                          cwd=env_path)


LOAD_AND_CHECK = """
import warnings, torch
from ckptq.codec import codebooks, ops
from ckptq.kernels import native
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    lib = native.library()
x = torch.randn(5000)
q = codebooks.dynamic_map(True)
same = torch.equal(*(ops.quantize_blockwise(x, q, backend=b)[0] for b in ("torch", "native")))
print(lib is not None, same, len([w for w in caught if "ckptq" in str(w.message)]))
"""


def test_a_truncated_library_is_rebuilt_never_loaded(env):
    """In a child process: dlopen of a truncated library dies of SIGBUS, which would take pytest along."""
    assert native.library() is not None, native.why_unavailable()
    (lib,) = (env / "cache").glob("cpu_kernels-*.so")
    whole = lib.read_bytes()
    # ELF headers intact, segments cut short; as a new file, since this process has the old one mapped
    # (truncating a mapped library in place is SIGBUS for whoever has it loaded, pytest included)
    cut = lib.with_name("cut.so")
    cut.write_bytes(whole[: len(whole) * 6 // 10])
    os.replace(cut, lib)
    done = _child(LOAD_AND_CHECK, env)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.split() == ["True", "True", "0"]  # rebuilt quietly, and it works
    assert hashlib.sha256(lib.read_bytes()).hexdigest() == (env / "cache" / (lib.name + ".sha256")).read_text().strip()
    assert _compiles(env) == 2


def test_a_cached_library_without_the_kernels_is_rebuilt(env):
    cache = env / "cache"
    cache.mkdir(mode=0o700)
    target = _compile(STUB, cache / native._build_name(native._compiler()))
    _record(target)  # hash intact: only the missing symbols give it away
    assert native.library() is not None, native.why_unavailable()
    assert _native_matches_torch() and _compiles(env) == 1


def test_a_compiler_that_builds_no_kernels_means_pytorch_with_one_warning(env, monkeypatch):
    stub = env / "stub.c"
    stub.write_text(STUB)
    monkeypatch.setenv("CKQ_TEST_STUB", str(stub))
    for compiles in (1, 2):  # empty cache: one build; then a cached bad build: rebuilt once
        native._load.cache_clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert native.library() is None
        assert len(caught) == 1 and "lacks a kernel" in str(caught[0].message), [str(w.message) for w in caught]
        assert _compiles(env) == compiles
    assert ops.resolve_backend("auto", torch.device("cpu")) == "torch"


# One import of torch (seconds), then six forked processes that ask for the library at the same moment.
# The parent only imports (no torch op has started a thread yet), so forking it is safe.
SIX_AT_ONCE = """
import os, sys, time
from ckptq.kernels import native
go = os.path.join(sys.argv[1], "go")
kids = []
for _ in range(6):
    pid = os.fork()
    if pid == 0:
        while not os.path.exists(go):
            time.sleep(0.001)
        ok = native.library() is not None
        os.write(1, f"{ok}\\n".encode() if ok else f"{native.why_unavailable()}\\n".encode())
        os._exit(0)
    kids.append(pid)
open(go, "w").close()
sys.exit(max(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0 for pid in kids))
"""


def test_six_processes_at_once_on_an_empty_cache_compile_once(env):
    done = _child(SIX_AT_ONCE, env, str(env))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True"] * 6, done.stdout
    assert _compiles(env) == 1
    assert not list((env / "cache").glob(".tmp-*"))  # no temporary files left behind


def test_stale_temporary_files_are_removed_by_the_next_build(env):
    cache = env / "cache"
    cache.mkdir(mode=0o700)
    (cache / ".tmp-cpu_kernels-killed.so").write_bytes(b"half a build")
    assert native.library() is not None
    assert not list(cache.glob(".tmp-*"))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 -march names")
def test_cpus_the_compiler_resolves_differently_get_different_builds(env, monkeypatch):
    """Same compiler command, version and /proc/cpuinfo; only what -march=native resolves to differs
    (as on two machines sharing a home folder). The same CPU twice gives the same build (the key holds
    no temporary file names)."""
    def path_for(march: str) -> Path:
        monkeypatch.setenv("CKQ_TEST_MARCH", march)
        return native.build_path(native._compiler())

    assert path_for("x86-64-v2") != path_for("x86-64-v3") != path_for("x86-64")
    assert path_for("x86-64-v3") == path_for("x86-64-v3")


@pytest.fixture
def fresh_build(tmp_path, monkeypatch, memo):
    """An empty kernel cache (in ``tmp_path/cache``), the wrapper as CC; the loader's memo is reset before and
    after."""
    _use_wrapper(tmp_path, memo, monkeypatch)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("CKPTQ_CACHE_DIR", str(cache))
    native._load.cache_clear()
    yield cache
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
    monkeypatch.setenv("CC", f"env {os.environ['CC']}")  # the wrapper, after env
    target = native.build_path(native._compiler())
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(b"not a shared object")  # what dlopen makes of a build it cannot read
    assert native.library() is not None, native.why_unavailable()
    assert target.stat().st_size > 1000
    x = torch.randn(3000)
    qmap = codebooks.dynamic_map(True)
    assert torch.equal(*(ops.quantize_blockwise(x, qmap, backend=b)[0] for b in ("torch", "native")))
