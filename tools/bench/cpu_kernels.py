"""Benchmark the C kernels: the Adam step (per-element cost, the grouped step against a per-member loop)
and the codec (quantize / dequantize throughput beside a memory copy).

    PYTHONPATH=. python tools/bench/cpu_kernels.py --rounds 9 [--against REV] [--march native,x86-64-v2]
    PYTHONPATH=. python tools/bench/cpu_kernels.py --what codec --numel 67108864 --against main --march native,x86-64-v2

``step``: the fused 8-bit step (the AdamW8bit layout: ratio codes on power-signed-1.5, sqrt(v) on
power-unsigned-3, block 256, fp32 params and grads; on 16.8 M elements in 4 tensors, and on 262 K that
stay in L2) and the 4-bit budget's 6 + 2-bit step (stochastic rounding, block 128) on 16.8 M elements,
one backend call per tensor: ms per step (wall) and cycles per parameter (the CPU time of all the
process's threads x the nominal clock / elements: robust to other load on the machine, which wall time
is not), at 1 and 2 threads.
``group``: 256 tensors of 4,096 and the d=256 x 48 layout (per layer q, k, v, o [256, 256], up
[1024, 256], down [256, 1024] in low-bit state and two LayerNorm weights [256] in the dense group):
``adam_step_group`` + ``adam_dense_group`` against the per-member loop of ``adam_step`` and the dense
reference, and torch's fused AdamW on the same tensors as the anchor.

``codec``: ``backend_native.quantize`` and ``dequantize`` of ``--numel`` fp32 elements (an Adam first
moment, randn * 1e-3) at 8 bits (block 256) and 4 bits (block 128), into buffers reused across rounds, in
GB/s of bytes read + written, beside ``torch.clone`` of the same fp32 tensor (a memory copy: 4 bytes read
and 4 written per element) and ``copy_`` into a reused buffer.

With ``--against REV`` the ``kernels/`` package of that git revision is loaded beside this one (as a
package of its own, with its own C build) and every figure is measured for both in interleaved rounds
(A, B, A, B...: load from other processes hits both alike); the table gives medians and the ratio.
``--march A,B`` builds this checkout's kernels once per -march (``CKPTQ_NATIVE_MARCH``: x86-64-v2 is the
scalar C path, x86-64-v3 the AVX2 one; ``native`` this CPU's widest) and measures each as its own column.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", help="a git revision whose kernels/ to measure beside this checkout's")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--what", default="step,group", help="comma-separated: step, group, codec")
    ap.add_argument("--march", help="comma-separated -march caps (CKPTQ_NATIVE_MARCH): this checkout built with each")
    ap.add_argument("--numel", type=int, default=1 << 26, help="elements of the codec's tensor (default 64M)")
    return ap


if __name__ == "__main__":
    build_parser().parse_args()  # --help and usage errors answer here, before torch and ckptq load

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # python -P leaves the tool's folder off sys.path
import harness  # noqa: E402
import torch  # noqa: E402

from ckptq.codec import ops, policy  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TSC_HZ = 2.6e9  # this machine's nominal (TSC) clock; cycles are wall time x this, not counted events


def tsc_hz() -> float:
    """The CPU's nominal clock from /proc/cpuinfo (cpu MHz), else TSC_HZ."""
    try:
        with open("/proc/cpuinfo") as f:
            mhz = [float(line.split(":")[1]) for line in f if line.startswith("cpu MHz")]
        return mhz[0] * 1e6 if mhz else TSC_HZ
    except OSError:
        return TSC_HZ


def load_kernels(rev: str | None, march: str | None = None):
    """This checkout's kernels package, or REV's ``kernels/`` extracted into a temp folder and imported as
    ``ckq_kernels_<rev>`` (the package imports nothing from ckptq, so it loads on its own). With ``march``
    (CKPTQ_NATIVE_MARCH for its build), a package of its own too (this checkout's files when rev is None),
    its C library built now, under that cap."""
    if rev is None and march is None:
        from ckptq import kernels
        from ckptq.kernels import backend_native, backend_torch, contract  # noqa: F401 (attributes of kernels)

        return kernels
    name = "ckq_kernels_" + "".join(c if c.isalnum() else "_" for c in f"{rev or 'checkout'}_{march or 'native'}")
    folder = Path(tempfile.mkdtemp(prefix="bench-kernels-")) / name
    folder.mkdir()
    if rev is None:
        for path in (ROOT / "kernels").iterdir():
            if path.suffix in (".py", ".c", ".h"):
                shutil.copy(path, folder / path.name)
    else:
        files = subprocess.run(["git", "ls-tree", "--name-only", rev, "kernels/"], cwd=ROOT, check=True,
                               capture_output=True, text=True).stdout.split()
        for path in files:
            blob = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True).stdout
            (folder / Path(path).name).write_bytes(blob)
    # kernels/__init__.py hands any name but ckptq.kernels to the installed package: this copy's own is empty
    (folder / "__init__.py").write_text("")
    sys.path.insert(0, str(folder.parent))
    package = importlib.import_module(name)
    for module in ("contract", "backend_native", "backend_torch"):
        importlib.import_module(f"{name}.{module}")
    with mock.patch.dict(os.environ, {"CKPTQ_NATIVE_MARCH": march} if march else {}):
        assert package.native.library() is not None, package.native.why_unavailable()
    return package


def hyper(step: int = 10, lr: float = 1e-3, wd: float = 0.01, eps: float = 1e-8) -> torch.Tensor:
    """AdamW's fp32 [10] step scalars (``contract.HYPER_FIELDS``) at ``step``, ratio eps' = eps."""
    b1, b2 = 0.9, 0.999
    return torch.tensor([1 - lr * wd, 0.0, 1 - b1, b2, 1 - b2, eps, -lr / (1 - b1**step), (1 - b2**step) ** 0.5,
                         eps, eps], dtype=torch.float32)


class Moments:
    """One parameter with quantized moments (ratio + sqrt(v) codes) and a gradient."""

    def __init__(self, n: int, bits: tuple[int, int], block: int, row_len: int | None, gen: torch.Generator):
        self.p = torch.randn(n, generator=gen)
        self.g = torch.randn(n, generator=gen) * 1e-2
        self.bits, self.block, self.row_len = bits, block, row_len
        m = torch.randn(n, generator=gen) * 1e-3
        v = torch.randn(n, generator=gen) ** 2 * 1e-6
        self.books = (policy.ratio_policy(bits[0]).qmap(), policy.policy_for("exp_avg_sq", bits[1]).qmap())
        self.codes, self.absmax = [], []
        for x, book, width, transform in ((m / (v.sqrt() + 1e-8), self.books[0], bits[0], "none"),
                                          (v, self.books[1], bits[1], "sqrt")):
            c, a = ops.quantize_blockwise(x, book, block, transform, "torch", width, row_len)
            self.codes.append(c)
            self.absmax.append(a)

    def states(self, contract) -> tuple:
        return tuple(contract.StepState(c, a, q, ops.midpoints(q), q, w)
                     for c, a, q, w in zip(self.codes, self.absmax, self.books, self.bits))

    def member(self, contract):
        return contract.GroupMember(self.p, tuple(self.codes), tuple(self.absmax), self.row_len or self.p.numel())


class Case:
    """What one figure times: ``run(kernels)`` steps every parameter once with that kernels package
    (``moved``: the bytes it reads and writes, for a GB/s figure; None: none given)."""

    def __init__(self, label: str, numel: int, run, moved: int | None = None):
        self.label, self.numel, self.run, self.moved = label, numel, run, moved


def codec_cases(numel: int, gen) -> list[Case]:
    """quantize and dequantize of numel fp32 values at 8 bits (block 256) and 4 bits (block 128), into
    buffers reused across calls; torch.clone and copy_ of the same fp32 tensor as the memory-copy anchors
    (they run the same whatever kernels package is passed)."""
    x = torch.randn(numel, generator=gen) * 1e-3
    out, copy_into = torch.empty(numel), torch.empty(numel)
    cases = []
    for bits, block in ((8, 256), (4, 128)):
        qmap = policy.ratio_policy(bits).qmap()  # the first moment's codes (a ratio) at this width
        thresholds = ops.midpoints(qmap)
        codes = torch.empty((numel * bits + 7) // 8, dtype=torch.uint8)
        absmax = torch.empty(-(-numel // block))
        moved = 4 * numel + codes.numel() + 4 * absmax.numel()  # either way: fp32 values, codes, scales
        cases.append(Case(f"quantize {bits}-bit (block {block})", numel, lambda k, t=thresholds, b=block, c=codes,
                          a=absmax, w=bits: k.backend_native.quantize(x, t, b, False, c, a, w), moved))
        cases.append(Case(f"dequantize {bits}-bit (block {block})", numel, lambda k, q=qmap, b=block, c=codes,
                          a=absmax, w=bits: k.backend_native.dequantize(c, a, q, b, False, out, False, w), moved))
    cases.append(Case("copy: torch.clone (fp32)", numel, lambda k: x.clone(), 8 * numel))
    cases.append(Case("copy: copy_ into a reused buffer (fp32)", numel, lambda k: copy_into.copy_(x), 8 * numel))
    return cases


def step_case(label: str, shapes, bits, block: int, seed: int | None, gen) -> Case:
    """One ``adam_step`` call per tensor (the per-member path), as ckptq.ops sends it to the backend."""
    params = [Moments(n, bits, block, None, gen) for n in shapes]
    h = hyper()

    def run(kernels) -> None:
        flags = kernels.contract.StepFlags(block, True, False, seed)
        for q in params:
            kernels.backend_native.adam_step(q.p, q.g, q.states(kernels.contract), h, flags)

    return Case(label, sum(shapes), run)


def d256x48() -> tuple[list[tuple[int, int]], list[int]]:
    """48 layers of d=256: the low-bit members (rows, row_len) and the dense members' sizes."""
    low = [(256, 256)] * 4 + [(1024, 256), (256, 1024)]
    return low * 48, [256, 256] * 48


class Groups:
    """A model's tensors as one low-bit step group (8-bit ratio + sqrt(v) codes, rows of their row length,
    block 256) and one dense group, built once per kernels package (as an optimizer keeps its groups)."""

    def __init__(self, low: list[tuple[int, int]], dense: list[int], gen: torch.Generator):
        self.params = [Moments(r * c, (8, 8), 256, c, gen) for r, c in low]
        self.dense_p = [torch.randn(n, generator=gen) for n in dense]
        self.dense_g = [torch.randn(n, generator=gen) * 1e-2 for n in dense]
        self.moments = [(torch.zeros(n), torch.rand(n, generator=gen) * 1e-6) for n in dense]
        self.numel = sum(r * c for r, c in low) + sum(dense)
        self.built: dict = {}

    def of(self, kernels):
        """(StepGroup, DenseGroup) in that package's contract types, the same objects at every call."""
        if kernels.__name__ not in self.built:
            c, books = kernels.contract, self.params[0].books
            codebooks = tuple(c.StepCodebooks(q, ops.midpoints(q), q) for q in books)
            step = c.StepGroup(tuple(q.member(c) for q in self.params), tuple(q.g for q in self.params),
                               hyper().repeat(len(self.params), 1), None, codebooks, (8, 8), 256, True, False, {})
            dense = c.DenseGroup(tuple(self.dense_p), tuple(self.dense_g), tuple(self.moments),
                                 hyper().repeat(len(self.dense_p), 1), False, {})
            self.built[kernels.__name__] = (step, dense)
        return self.built[kernels.__name__]


def grouped(groups: Groups, kernels) -> None:
    """The grouped step (a revision without it: the per-member loop) and the dense group."""
    step, dense = groups.of(kernels)
    native = kernels.backend_native
    if hasattr(native, "adam_step_group"):
        native.adam_step_group(step)
    else:
        _loop(kernels, step)
    if dense.params:
        getattr(native, "adam_dense_group", kernels.backend_torch.adam_dense_group)(dense)


def member_loop(groups: Groups, kernels) -> None:
    """One ``adam_step`` call per low-bit member (the per-parameter path), the dense group as the reference."""
    step, dense = groups.of(kernels)
    _loop(kernels, step)
    kernels.backend_torch.adam_dense_group(dense)


def group_cases(label: str, low: list[tuple[int, int]], dense: list[int], gen) -> list[Case]:
    """The grouped step, the per-member loop of the same kernels, and torch's fused AdamW on tensors of
    the same shapes."""
    groups = Groups(low, dense, gen)
    fused_p = [torch.nn.Parameter(torch.randn(r * c, generator=gen)) for r, c in low] + \
        [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in dense]
    for p in fused_p:
        p.grad = torch.randn(p.numel(), generator=gen) * 1e-2
    fused = torch.optim.AdamW(fused_p, lr=1e-3, fused=True)
    return [Case(f"{label}: grouped", groups.numel, lambda kernels: grouped(groups, kernels)),
            Case(f"{label}: per-member loop", groups.numel, lambda kernels: member_loop(groups, kernels)),
            Case(f"{label}: torch fused AdamW", groups.numel, lambda kernels: fused.step())]


def _loop(kernels, group) -> None:
    """The grouped step as one ``adam_step`` per member (the per-parameter path)."""
    c = kernels.contract
    for i, (m, g) in enumerate(zip(group.members, group.grads)):
        states = tuple(c.StepState(codes, a, cb.qmap, cb.thresholds, cb.encode, bits)
                       for codes, a, cb, bits in zip(m.codes, m.absmax, group.codebooks, group.bits))
        flags = c.StepFlags(group.block_size, group.ratio, group.maximize, None, m.row_len)
        kernels.backend_native.adam_step(m.p, g, states, group.hyper[i], flags)


def measure(cases: list[Case], impls: dict, threads: int, rounds: int, warmup: int = 2) -> dict:
    """{(case label, impl name): [(wall seconds, CPU seconds of the process) per round]}: interleaved
    rounds, each case x impl once per round. CPU time counts only while this process's threads run, so
    it holds up on a machine shared with other work (wall time does not)."""
    torch.set_num_threads(threads)
    times: dict = {}
    for r in range(warmup + rounds):
        for case in cases:
            for name, kernels in impls.items():
                wall, cpu = time.perf_counter(), time.process_time()
                case.run(kernels)
                if r >= warmup:
                    spent = (time.perf_counter() - wall, time.process_time() - cpu)
                    times.setdefault((case.label, name), []).append(spent)
    return times


def table(cases: list[Case], impls: dict, times: dict, threads: int, hz: float) -> str:
    """Medians per case and implementation: wall ms, and cycles per parameter from the CPU time of all
    threads (CPU seconds x the nominal clock / elements), or GB/s (bytes read + written / wall time) for
    cases that say what they move; with two implementations, the ratio of the last one's wall time to
    the first's."""
    names = list(impls)
    gbps = any(case.moved for case in cases)
    unit = "GB/s" if gbps else "cycles/param"
    head = "| case | threads | " + " | ".join(f"{n}: ms | {n}: {unit}" for n in names)
    rule = "|" + "---|" * (2 + 2 * len(names) + (len(names) == 2))
    lines = [head + (" | ratio |" if len(names) == 2 else " |"), rule]
    for case in cases:
        wall = [statistics.median(w for w, _ in times[(case.label, n)]) for n in names]
        cpu = [statistics.median(c for _, c in times[(case.label, n)]) for n in names]
        if gbps:
            cells = [f"{w * 1e3:.1f} | {case.moved / w / 1e9:.2f}" for w in wall]
        else:
            cells = [f"{w * 1e3:.2f} | {c * hz / case.numel:.2f}" for w, c in zip(wall, cpu)]
        ratio = f" {wall[1] / wall[0]:.2f}x |" if len(names) == 2 else ""
        lines.append(f"| {case.label} | {threads} | " + " | ".join(cells) + " |" + ratio)
    return "\n".join(lines)


def main() -> None:
    args = build_parser().parse_args()
    impls = {f"{args.against}": load_kernels(args.against)} if args.against else {}
    for march in (args.march or "native").split(","):
        impls["new" if march == "native" else f"new@{march}"] = load_kernels(None, None if march == "native" else march)
    gen = torch.Generator().manual_seed(0)
    cases = []
    if "codec" in args.what:
        cases += codec_cases(args.numel, gen)
    if "step" in args.what:
        cases += [step_case("8-bit step, 16.8M in 4", [1 << 22] * 4, (8, 8), 256, None, gen),
                  step_case("8-bit step, 262K in 1 (in L2)", [1 << 18], (8, 8), 256, None, gen),
                  step_case("6+2-bit step (seeded), 16.8M in 4", [1 << 22] * 4, (6, 2), 128, 12345, gen)]
    if "group" in args.what:
        cases += group_cases("256 x 4096", [(16, 256)] * 256, [], gen)
        cases += group_cases("d=256 x 48", *d256x48(), gen)
    hz = tsc_hz()
    print(f"{harness.machine_line()}; cycles at {hz / 1e9:.2f} GHz (nominal clock); medians of {args.rounds} interleaved rounds")
    for t in map(int, args.threads.split(",")):
        for part in ([c for c in cases if c.moved], [c for c in cases if not c.moved]):
            if part:
                print(table(part, impls, measure(part, impls, t, args.rounds), t, hz))


if __name__ == "__main__":
    main()
