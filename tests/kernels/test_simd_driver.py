"""Every SIMD path of the C kernels (ckptq/kernels/simd*.h) against the PyTorch reference, bit for bit, on
machines other than this one too: tests/kernels/simd_driver.c is compiled with the kernels for each target,
run there (aarch64 under qemu-user when this machine is not one), and fed inputs and scripts that this
test writes; its outputs must equal what the reference computes.

Targets: scalar C and AVX2 on any x86-64 machine (builds capped with -march, as CKPTQ_NATIVE_MARCH
caps the kernels' own build), this machine's -march=native (AVX-512 where it has it), and aarch64 NEON
and aarch64 scalar C (-march=armv8-a+nosimd), cross-compiled with Debian's gcc-aarch64-linux-gnu and
run with Debian's qemu-user (``.ci/run`` installs both; without them those targets skip, saying so).
Operations: quantize and dequantize at every width (8, 6, 4, 2), transform (none, sqrt) and source
dtype (fp32, bf16, fp16), flat and in rows with short last blocks, codes of 4 and 2 bits from the
code table and from the thresholds; stochastic rounding's encode (hashes of the elements' indices,
either half) at every width; the 16-bit <-> fp32 conversions; the partial vectors (v_load_n, v_store_n)
a block's last len % VL values take (the steps: tests/kernels/test_step_driver.py, on the same targets). Values:
many decades, zeros, -0.0, subnormals, NaN, +-inf, and every threshold of the codebook with its neighbours (blocks whose absmax is 1).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptq.codec import policy
from ckptq.kernels import backend_torch, lut
from ckptq.kernels.contract import layout_blocks, midpoints, pack_rows
from tests.helpers.paths import ROOT
from tests.kernels.cases import cpu_flags

KERNELS = ROOT / "kernels"
DRIVER = Path(__file__).with_name("simd_driver.c")
FLAGS = ["-O2", "-std=c99", "-ffp-contract=off", "-fno-math-errno"]  # the kernels' arithmetic flags (native.py)
X86 = platform.machine() in ("x86_64", "AMD64")
ARM64 = platform.machine() in ("aarch64", "arm64")

SIGNED = {8: policy.ratio_policy(8).qmap(), 6: policy.ratio_policy(6).qmap(), 4: policy.ratio_policy(4).qmap(),
          2: torch.tensor([-1.0, -0.3, 0.0, 1.0])}
UNSIGNED = {8: policy.policy_for("exp_avg_sq", 8).qmap(), 6: torch.linspace(0, 1, 64) ** 2,
            4: policy.policy_for("exp_avg_sq", 4).qmap(), 2: policy.policy_for("exp_avg_sq", 2).qmap()}
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# (n, row_len, block): flat with a short last block, and rows whose blocks end short inside each row
LAYOUTS = [(1000, 1000, 64), (5 * 150, 150, 64), (3 * 300, 300, 256)]


def _targets() -> dict[str, tuple]:
    """name -> (compiler, its target flags, runner prefix, the SIMD path it must compile (None: whatever
    native is), why it cannot run here or None)."""
    cc = shutil.which(os.environ.get("CC") or "cc")
    out = {}
    if X86:
        v3 = {"avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "abm"}  # what -march=x86-64-v3 lets gcc use
        avx2 = None if cc and v3 <= cpu_flags() else f"needs a C compiler and a CPU with {sorted(v3)}"
        out["x86-scalar"] = (cc, ["-march=x86-64-v2"], [], "scalar", None if cc else "no C compiler")
        out["x86-avx2"] = (cc, ["-march=x86-64-v3"], [], "avx2", avx2)
        out["x86-avx2-no-f16c"] = (cc, ["-march=x86-64-v3", "-mno-f16c"], [], "avx2", avx2)  # fp16 lane by lane
        out["native"] = (cc, ["-march=native"], [], None, None if cc else "no C compiler")
    if ARM64:
        out["aarch64-neon"] = (cc, ["-march=armv8-a"], [], "neon", None if cc else "no C compiler")
        out["aarch64-scalar"] = (cc, ["-march=armv8-a+nosimd"], [], "scalar", None if cc else "no C compiler")
    else:
        cross, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
        missing = [what for what, found in (("aarch64-linux-gnu-gcc (apt install gcc-aarch64-linux-gnu)", cross),
                                            ("qemu-aarch64 (apt install qemu-user)", qemu)) if not found]
        why = "missing " + " and ".join(missing) if missing else None
        runner = [qemu, "-L", "/usr/aarch64-linux-gnu"] if qemu else []
        out["aarch64-neon"] = (cross, ["-march=armv8.2-a"], runner, "neon", why)
        out["aarch64-scalar"] = (cross, ["-march=armv8-a+nosimd"], runner, "scalar", why)
    return out


TARGETS = _targets()


def _values(n: int, signed: bool, qmap: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Specials first (zeros, -0.0, subnormals, NaN, +-inf), then blocks of 64 led by a 1.0 (absmax 1:
    y = x exactly) holding every threshold and its neighbours, then values over many decades."""
    t = midpoints(qmap)
    edges = torch.cat([t, torch.nextafter(t, torch.tensor(2.0)), torch.nextafter(t, torch.tensor(-2.0)), qmap])
    edges = edges[edges.abs() <= 1]
    per = 63
    nb = -(-edges.numel() // per)
    body = torch.zeros(nb * per)
    body[: edges.numel()] = edges
    edge_blocks = torch.cat([torch.ones(nb, 1), body.view(nb, per)], 1).view(-1)
    x = torch.randn(n, generator=gen) * 10.0 ** torch.empty(n).uniform_(-30, 3, generator=gen)
    x[:64] = 0.0
    x[64:72] = -0.0
    x[72:80] = 1e-42
    x[81], x[150], x[152], x[153] = float("nan"), float("inf"), -float("inf"), 3e38
    k = min(edge_blocks.numel(), n - 256)
    x[256 : 256 + k] = edge_blocks[:k]
    return x if signed else x.abs()


def _read(path: Path, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.fromfile(path, dtype=np.uint8)).view(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, any NaN equal to any NaN (payloads are not in the contract)."""
    if a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    width = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a[~nan].view(width), b[~nan].view(width))


def _stochastic_reference(x: torch.Tensor, row_len: int, block: int, q: torch.Tensor, seed: int, high: bool):
    """The steps' stochastic rounding of x (fp32, rows of row_len) written out with backend_torch's pieces:
    nearest codes and scales per block (reference_codes), uniforms of each element's index, stochastic_codes."""
    rows = x.numel() // row_len
    per_row = -(-row_len // block)
    padded = torch.zeros(rows, per_row * block)
    padded[:, :row_len] = x.view(rows, row_len)
    index = torch.zeros(rows, per_row * block, dtype=torch.int64)
    index[:, :row_len] = torch.arange(x.numel()).view(rows, row_len)
    blocks = padded.view(-1, block)
    nearest, absmax = backend_torch.reference_codes(blocks.reshape(-1), midpoints(q), block)
    u = backend_torch.uniforms(index.view(-1), index.numel(), seed, x.device)[0 if high else 1]
    codes = backend_torch.stochastic_codes(blocks, absmax, nearest.view(blocks.shape), q, u.view(blocks.shape))
    return pack_rows(codes.view(rows, -1)[:, :row_len].contiguous(), _bits_of(q)).reshape(-1), absmax


def _bits_of(q: torch.Tensor) -> int:
    return {256: 8, 64: 6, 16: 4, 4: 2}[q.numel()]


class Script:
    """The driver's script being written: its lines, and per line (what, [(output file, dtype, expected)])."""

    def __init__(self, folder: Path):
        self.folder, self.lines, self.checks = folder, [], []

    def file(self, name: str, t: torch.Tensor) -> str:
        """t's bytes (little-endian, as the driver reads them) in a file of the folder; its path."""
        path = self.folder / name
        path.write_bytes(t.contiguous().view(torch.uint8).numpy().tobytes())
        return str(path)

    def add(self, line: str, what: str, outputs: list) -> None:
        self.lines.append(line)
        self.checks.append((what, outputs))


def _codec_lines(script: Script, bits: int, signed: bool, gen: torch.Generator) -> None:
    """quantize (code table, and thresholds at 4 and 2 bits) and dequantize of every layout and dtype, the
    signed codebook without the transform or the unsigned one with sqrt; stochastic rounding of fp32 values
    (as the steps encode) from either half of the hash."""
    qmap, sqrt, f = (SIGNED if signed else UNSIGNED)[bits], not signed, script.folder
    thresholds = midpoints(qmap)
    table = script.file(f"table{bits}{signed}", lut.native_code_table(thresholds))
    thr = script.file(f"thr{bits}{signed}", thresholds)
    decode = script.file(f"decode{bits}{signed}", torch.cat([qmap, torch.zeros(256 - qmap.numel())]))
    q = script.file(f"q{bits}{signed}", qmap)
    by_table = (False, True) if bits <= 4 else (False,)
    for li, (n, row_len, block) in enumerate(LAYOUTS):
        x = _values(n, signed, qmap, gen)
        for dtype, code in DTYPES.items():
            tag = f"{bits}-{'sqrt' if sqrt else 'none'}-{li}-{str(dtype)[6:]}"
            codes = torch.zeros((n // row_len) * ((row_len * bits + 7) // 8), dtype=torch.uint8)
            absmax, out = torch.zeros(layout_blocks(n, row_len, block)), torch.zeros(n)
            backend_torch.quantize(x.to(dtype), thresholds, block, sqrt, codes, absmax, bits, row_len)
            backend_torch.dequantize(codes, absmax, qmap, block, sqrt, out, False, bits, row_len)
            src = script.file(f"src-{tag}", x.to(dtype))
            for use_thr in by_table:
                c, a = f / f"codes-{tag}-{use_thr}", f / f"absmax-{tag}-{use_thr}"
                script.add(f"quantize {src} {code} {n} {row_len} {block} {int(sqrt)} {bits} {table} "
                           f"{thr if use_thr else '-'} {c} {a}", f"quantize {tag}{' thresholds' if use_thr else ''}",
                           [(c, torch.uint8, codes), (a, torch.float32, absmax)])
            c, a, o = script.file(f"rcodes-{tag}", codes), script.file(f"rabsmax-{tag}", absmax), f / f"out-{tag}"
            script.add(f"dequantize {c} {a} {decode} {n} {row_len} {block} {int(sqrt)} {bits} {o}",
                       f"dequantize {tag}", [(o, torch.float32, out)])
        xs = script.file(f"sx-{bits}{signed}{li}", x)
        for high in (1, 0):
            seed = 12345 + 7 * li + high
            ref_c, ref_a = _stochastic_reference(x, row_len, block, qmap, seed, bool(high))
            for use_thr in by_table:
                tag = f"{bits}-{signed}-{li}-{high}-{use_thr}"
                c, a = f / f"scodes-{tag}", f / f"sabsmax-{tag}"
                script.add(f"stochastic {xs} {n} {row_len} {block} {bits} {table} {thr if use_thr else '-'} {q} "
                           f"{seed} {high} {c} {a}", f"stochastic {tag}",
                           [(c, torch.uint8, ref_c), (a, torch.float32, ref_a)])


def _conversion_lines(script: Script, gen: torch.Generator) -> None:
    """16-bit <-> fp32 (load_block, store_block): every bf16 and fp16 pattern to fp32; fp32 values to both,
    around every rounding case (each bf16 value plus noise, fp16 subnormals and overflow, NaNs that
    rounding the bits would turn into inf or -0.0)."""
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    nans = torch.tensor([0x7F800001, 0xFF800001, 0x7FFFFFFF, 0x7FBFFFFF, 0x7FC00000, 0xFFFFFFFF],
                        dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat([_values(4099, True, SIGNED[8], gen), torch.randn(4096, generator=gen) * 1e-6,
                   torch.randn(4096, generator=gen) * 6e4,
                   every.view(torch.bfloat16).float() + torch.randn(65536, generator=gen) * 1e-3, nans])
    xs = script.file("conv-f32", x)
    for dtype, code in ((torch.bfloat16, 1), (torch.float16, 2)):
        src, out = script.file(f"conv-{code}", every.view(dtype)), script.folder / f"load-{code}"
        script.add(f"load {src} {code} {every.numel()} {out}", f"load {dtype}",
                   [(out, torch.float32, every.view(dtype).float())])
        out = script.folder / f"store-{code}"
        script.add(f"store {xs} {x.numel()} {code} {out}", f"store {dtype}", [(out, dtype, x.to(dtype))])


def _partial_lines(script: Script, gen: torch.Generator) -> None:
    """v_load_n / v_store_n (a block's last len % VL values, as a step's rule would read and write them):
    lengths around every path's vector, and nothing written past them."""
    x = torch.randn(40, generator=gen)
    src = script.file("partial-src", x)
    pattern = torch.full((16,), 0xA5A5A5A5 - (1 << 32), dtype=torch.int32).view(torch.float32)
    for n in (1, 2, 3, 5, 7, 9, 13, 15, 17, 23, 31, 33):
        out = script.folder / f"partial-{n}"
        script.add(f"partial {src} {n} {out}", f"partial {n}", [(out, torch.float32, torch.cat([x[:n], pattern]))])


def _cases(folder: Path) -> Script:
    script, gen = Script(folder), torch.Generator().manual_seed(36)
    for bits in (8, 6, 4, 2):
        for signed in (True, False):
            _codec_lines(script, bits, signed, gen)
    _conversion_lines(script, gen)
    _partial_lines(script, gen)
    return script


def _build(name: str, folder: Path) -> tuple[Path | None, str]:
    """(the driver built for target ``name``, ""), or (None, the compiler's complaint)."""
    cc, target_flags, _, _, _ = TARGETS[name]
    exe = folder / f"driver-{name}"
    done = subprocess.run([cc, *FLAGS, *target_flags, f"-I{KERNELS}", "-o", str(exe), str(DRIVER), "-lm"],
                          capture_output=True, text=True, timeout=300)
    return (exe, "") if done.returncode == 0 else (None, done.stderr[-3000:])


def prepare(folder: Path, build, make_cases) -> tuple:
    """Every runnable target's driver compiled (``build(name, folder)``: (exe, error)) beside the reference's
    work (``make_cases(folder)``: a Script); (the script's path, its checks, {target: (exe, error)})."""
    runnable = [name for name, target in TARGETS.items() if not target[-1]]
    with ThreadPoolExecutor(max(1, len(runnable))) as pool:
        builds = {name: pool.submit(build, name, folder) for name in runnable}
        script = make_cases(folder)
        built = {name: f.result() for name, f in builds.items()}
    path = folder / "script.txt"
    path.write_text("\n".join(script.lines) + "\n")
    return path, script.checks, built


def run_target(target: str, cases: tuple) -> tuple[str, list]:
    """Run ``target``'s driver on the script (skipped where it cannot run here); (the SIMD path it says it
    was compiled with, [(what, output path)] of every output that differs from the reference's)."""
    _, _, runner, isa, why = TARGETS[target]
    if why:
        pytest.skip(f"{target}: {why}")
    script, checks, built = cases
    exe, error = built[target]
    assert exe is not None, error
    for out, _, _ in (o for _, outs in checks for o in outs):
        out.unlink(missing_ok=True)  # each target writes its own outputs
    done = subprocess.run([*runner, str(exe), str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    head, *oks = done.stdout.split("\n")
    assert head.startswith("isa "), done.stdout[:200]
    if isa is not None:
        assert head == f"isa {isa}", f"{target} compiled the {head[4:]} path, not {isa}"
    assert oks.count("ok") == len(checks)
    bad = [(what, path) for what, outs in checks for path, dtype, want in outs
           if not _same(_read(path, dtype), want.reshape(-1))]
    return head[4:], bad


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """The inputs, the script and the expected outputs, and every available target's driver."""
    return prepare(tmp_path_factory.mktemp("simd"), _build, _cases)


@pytest.mark.parametrize("target", list(TARGETS))
def test_every_operation_matches_the_reference_on_each_path(target, cases):
    isa, bad = run_target(target, cases)
    whats = list(dict.fromkeys(what for what, _ in bad))
    assert not whats, f"{target} ({isa}): {len(whats)} of {len(cases[1])} differ, e.g. {whats[:8]}"
