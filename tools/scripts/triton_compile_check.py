"""Compile the Triton kernels for a GPU without one (triton.compile with a GPUTarget; ptxas ships with
Triton) and check what the interpreter cannot: that they compile at all, that the step's arithmetic is
the contract's (no FMA, IEEE ``div.rn`` / ``sqrt.rn``), that aligned layouts get 128-bit loads, and that
nothing spills (no stack frame, no local memory: ``cuobjdump -res-usage``). Prints registers, stack and
local bytes and instruction counts per kernel; exits 1 if a check fails or a count cannot be read.

    python tools/scripts/triton_compile_check.py [--quick] [--arch 80 --arch 90]

``--quick``: one configuration of every kernel (the suite runs it for sm_80 and sm_90:
tests/kernels/test_triton_compile.py); without it, more widths, dtypes and flags. Run without TRITON_INTERPRET
(it is cleared here before triton is imported).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one configuration of every kernel")
    parser.add_argument("--arch", type=int, action="append", help="compute capability, e.g. 80 or 90 (repeatable; "
                        "default 90)")
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help and usage errors answer here, before torch and ckptq load

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be JIT functions, not interpreted ones

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ckptq.kernels import backend_triton, rules, triton_group, triton_step  # noqa: E402
from ckptq.kernels.contract import NONE, RATIO, SQRT  # noqa: E402

_STEP_TYPES = {"chunks": "*i64", "members": "*i64", "calls": "*i64", "hyper": "*fp32", "seeds": "*i64",
               "books": "*fp32"}
_DENSE_TYPES = {"chunks": "*i64", "members": "*i64", "calls": "*i64", "hyper": "*fp32"}
_CODEC_TYPES = {"codes_ptr": "*u8", "n_blocks": "i64", "row_len": "i64"}
_BF16 = {"p_like": "*bf16", "g_like": "*bf16"}


def _slot(bits: int, transform: int = NONE, divisor: int = -1, stochastic: bool = False):
    return triton_step.SlotShape(bits, transform, transform, divisor, stochastic)


def step_constexprs(rule: str, flags: int, slots: tuple, block: int = 256, aligned: bool = True) -> dict:
    """The template's constexprs for a rule, a flag word and its slots (``triton_step.SlotShape``), as
    ``triton_group.step`` launches it, at ``block`` (tiles of 2048 elements)."""
    r = rules.RULES[rule]
    last = len(r.fields) - 1
    eps = [r.fields.index(n) if n in r.fields else last for n in ("decode_eps", "encode_eps")]
    return dict(RULE=triton_step.RULES[rule], FLAGS=flags, FIELDS=len(r.fields), SLOTS=slots, DEC_EPS=eps[0],
                ENC_EPS=eps[1], OUT=rules.writes_direction(r, flags), STOCHASTIC=any(s.stochastic for s in slots),
                BLOCK=block, ROWS=2048 // block, ALIGNED=aligned)


def dense_constexprs(rule: str, flags: int) -> dict:
    r = rules.RULES[rule]
    return dict(RULE=triton_step.RULES[rule], FLAGS=flags, FIELDS=len(r.fields), OUT=rules.writes_direction(r, flags),
                STATES=len(r.states(flags)), TILE=2048, ALIGNED=True)


_ADAM4 = (_slot(4, RATIO, 1, True), _slot(4, SQRT, stochastic=True))
_AMSGRAD = rules.ADAM.flag("amsgrad")


def _cases(quick: bool) -> list[tuple]:
    """(name, kernel, arg types, constexprs): one configuration of every kernel first (the quick set)."""
    step = triton_step._step_kernel
    cases = [("step adam 4-bit seeded", step, _STEP_TYPES, step_constexprs("adam", 0, _ADAM4, 128)),
             ("step rmsprop heavy centered 8-bit", step, _STEP_TYPES,
              step_constexprs("rmsprop", 6, (_slot(8, SQRT), _slot(8), _slot(8)))),
             ("dense adam", triton_step._dense_kernel, _DENSE_TYPES, dense_constexprs("adam", 0)),
             ("quantize 8-bit sqrt", backend_triton._quantize_kernel, _CODEC_TYPES,
              dict(BLOCK=256, ROWS=8, SQRT=True, BITS=8, ALIGNED=True)),
             ("dequantize 6-bit", backend_triton._dequantize_kernel, _CODEC_TYPES,
              dict(BLOCK=256, ROWS=8, SQRT=False, BITS=6, ALIGNED=True))]
    if quick:
        return cases
    adam8 = (_slot(8, RATIO, 1), _slot(8, SQRT))
    return cases + [
        ("step adam 8-bit", step, _STEP_TYPES, step_constexprs("adam", 0, adam8)),
        ("step adam 6+2+4 amsgrad seeded bf16", step, {**_STEP_TYPES, **_BF16},
         step_constexprs("adam", _AMSGRAD, (_slot(6, RATIO, 1, True), _slot(2, SQRT, stochastic=True), _slot(4, SQRT)),
                         128)),
        ("step adam 4+4 unaligned", step, _STEP_TYPES, step_constexprs("adam", 0, _ADAM4, 128, aligned=False)),
        ("step rmsprop heavy centered 4-bit seeded unaligned", step, _STEP_TYPES,
         step_constexprs("rmsprop", 6, (_slot(4, SQRT, stochastic=True), _slot(4, stochastic=True),
                                        _slot(4, stochastic=True)), 64, aligned=False)),
        ("step adam 2+2 rows of <= 32", step, _STEP_TYPES,
         step_constexprs("adam", 0, (_slot(2, RATIO, 1), _slot(2, SQRT)), 32)),
        ("step nadam 8-bit seeded", step, _STEP_TYPES,
         step_constexprs("nadam", 0, (_slot(8, RATIO, 1, True), _slot(8, SQRT, stochastic=True)))),
        ("step radam 4-bit", step, _STEP_TYPES, step_constexprs("radam", 0, _ADAM4, 128)),
        ("step ademamix 8-bit seeded", step, _STEP_TYPES,
         step_constexprs("ademamix", 0, (_slot(8, stochastic=True), _slot(8, stochastic=True),
                                         _slot(8, SQRT, stochastic=True)))),
        ("step sgd 8-bit bf16", step, {**_STEP_TYPES, **_BF16}, step_constexprs("momentum", 2, (_slot(8),))),
        ("step lion 4-bit seeded", step, _STEP_TYPES,
         step_constexprs("momentum", 4, (_slot(4, stochastic=True),), 128)),
        ("step muon 8-bit", step, _STEP_TYPES, step_constexprs("momentum", 0, (_slot(8),))),
        ("step rmsprop heavy centered 4-bit seeded", step, _STEP_TYPES,
         step_constexprs("rmsprop", 6, (_slot(4, SQRT, stochastic=True), _slot(4, stochastic=True),
                                        _slot(4, stochastic=True)), 128)),
        ("step adagrad 8-bit", step, _STEP_TYPES, step_constexprs("adagrad", 0, (_slot(8, SQRT),))),
        ("dense adam amsgrad bf16", triton_step._dense_kernel, {**_DENSE_TYPES, **_BF16},
         dense_constexprs("adam", _AMSGRAD)),
        ("dense ademamix", triton_step._dense_kernel, _DENSE_TYPES, dense_constexprs("ademamix", 0)),
        ("dense rmsprop heavy centered", triton_step._dense_kernel, _DENSE_TYPES, dense_constexprs("rmsprop", 6)),
        ("dense muon", triton_step._dense_kernel, _DENSE_TYPES, dense_constexprs("momentum", 0)),
        ("dense rmsprop heavy centered unaligned bf16", triton_step._dense_kernel, {**_DENSE_TYPES, **_BF16},
         dict(dense_constexprs("rmsprop", 6), ALIGNED=False)),
    ]


def _resources(cubin: bytes) -> tuple[str, str, str]:
    """(registers, stack bytes, local bytes) from cuobjdump, or '?' each where it is not at hand. Spills go
    to the stack frame in local memory: 0 and 0 mean none."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return "?", "?", "?"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", out)
    return found.groups() if found else ("?", "?", "?")


def compile_case(kernel, types: dict, constexprs: dict, arch: int) -> dict:
    """Compile one configuration (every pointer 16-byte aligned, every size divisible by 16, as Triton
    specializes them) and count what matters in its PTX."""
    signature = {n: "constexpr" if n in constexprs else types.get(n, "*fp32") for n in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if signature[n].startswith("*") or n in ("n_blocks", "row_len")}
    options = {"enable_fp_fusion": False} if "RULE" in constexprs else {}
    if "RULE" in constexprs and not constexprs["ALIGNED"]:  # as triton_group launches unaligned tiles
        options["num_warps"] = 4 * triton_group.UNALIGNED_WARPS
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                              options=options)
    ptx = compiled.asm["ptx"]
    regs, stack, local = _resources(compiled.asm["cubin"])
    count = lambda pattern: len(re.findall(pattern, ptx))  # noqa: E731
    return {"regs": regs, "stack": stack, "local": local, "fma": count(r"\bfma\.rn\.f32"),
            "approx": count(r"\.approx\.f32"),
            "div.rn": count(r"\bdiv\.rn\.f32"), "sqrt.rn": count(r"\bsqrt\.rn\.f32"), "v4 loads": count(r"ld\.global[.a-z0-9]*\.v4")}


def check(name: str, constexprs: dict, r: dict) -> list[str]:
    """What is wrong with one compiled configuration (nothing: [])."""
    failures = []
    exact = "quantize" in name or "dequantize" in name or (r["fma"] == 0 and r["approx"] == 0)
    if not exact:
        failures.append(f"{name}: {r['fma']} FMA / {r['approx']} approximate ops break the contract's rounding")
    if constexprs.get("ALIGNED") and "dequantize" not in name and r["v4 loads"] == 0:
        failures.append(f"{name}: aligned, but no 128-bit loads")
    if "?" in (r["regs"], r["stack"], r["local"]):
        failures.append(f"{name}: registers and spills could not be read (cuobjdump -res-usage)")
    elif r["stack"] != "0" or r["local"] != "0":
        failures.append(f"{name}: {r['stack']} B stack, {r['local']} B local memory: registers spill")
    return failures


def main() -> int:
    args = build_parser().parse_args()
    failures = []
    for arch in args.arch or [90]:
        print(f"\nsm_{arch}\n\n| kernel | regs | stack | local | fma | approx | div.rn | sqrt.rn | v4 loads |\n"
              "|---|--:|--:|--:|--:|--:|--:|--:|--:|")
        for name, kernel, types, constexprs in _cases(args.quick):
            r = compile_case(kernel, types, constexprs, arch)
            print(f"| {name} | {r['regs']} | {r['stack']} | {r['local']} | {r['fma']} | {r['approx']} | {r['div.rn']} | "
                  f"{r['sqrt.rn']} | {r['v4 loads']} |")
            failures += [f"sm_{arch} {failure}" for failure in check(name, constexprs, r)]
    for failure in failures:
        print("FAILED", failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
