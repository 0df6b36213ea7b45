"""Compile the Triton kernels for a GPU without one (triton.compile with a GPUTarget; ptxas ships with
Triton) and check what the interpreter cannot: that they compile at all, that the step's arithmetic is
the contract's (no FMA, IEEE ``div.rn`` / ``sqrt.rn``), that aligned layouts get 128-bit loads, and that
nothing spills (no stack frame, no local memory: ``cuobjdump -res-usage``). Prints registers, stack and
local bytes and instruction counts per kernel; exits 1 if a check fails or a count cannot be read.

    python tools/triton_compile_check.py [--quick] [--arch 80 --arch 90]

``--quick``: one configuration of every kernel (the suite runs it for sm_80 and sm_90:
tests/test_triton_compile.py); without it, more widths, dtypes and flags. Run without TRITON_INTERPRET
(it is cleared here before triton is imported).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be JIT functions, not interpreted ones

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ckptq.kernels import backend_triton, triton_group  # noqa: E402

_HYPER = ("decay", "l2", "omb1", "beta2", "omb2", "eps", "neg_step", "bc2_sqrt", "dec_eps", "enc_eps")
_STEP_TYPES = {**{h: "fp32" for h in _HYPER}, "p_ptr": "*fp32", "g_ptr": "*fp32", "m_codes": "*u8", "v_codes": "*u8",
               "x_codes": "*u8", "seed": "i32", "n_blocks": "i64", "row_len": "i64"}
_GROUP_TYPES = {"chunks": "*i64", "members": "*i64", "grads": "*i64", "hyper": "*fp32", "seeds": "*i64"}
_STEP = dict(BLOCK=256, ROWS=8, M_RATIO=True, AMSGRAD=False, MAXIMIZE=False, M_BITS=8, V_BITS=8, X_BITS=8,
             STOCHASTIC=False, ALIGNED=True)
_DENSE = dict(TILE=2048, AMSGRAD=False, MAXIMIZE=False, ALIGNED=True)


_CODEC_TYPES = {"codes_ptr": "*u8", "n_blocks": "i64", "row_len": "i64"}


def _cases(quick: bool) -> list[tuple]:
    """(name, kernel, arg types, constexprs): one configuration of every kernel first (the quick set)."""
    bf16 = {"p_like": "*bf16", "g_like": "*bf16"}
    cases = [("group 4-bit seeded", triton_group._step_group_kernel, _GROUP_TYPES,
              dict(_STEP, BLOCK=128, ROWS=16, M_BITS=4, V_BITS=4, STOCHASTIC=True)),
             ("dense group", triton_group._dense_group_kernel, _GROUP_TYPES, _DENSE),
             ("step 8-bit", backend_triton._adam_kernel, _STEP_TYPES, _STEP),
             ("quantize 8-bit sqrt", backend_triton._quantize_kernel, _CODEC_TYPES,
              dict(BLOCK=256, ROWS=8, SQRT=True, BITS=8, ALIGNED=True)),
             ("dequantize 6-bit", backend_triton._dequantize_kernel, _CODEC_TYPES,
              dict(BLOCK=256, ROWS=8, SQRT=False, BITS=6, ALIGNED=True))]
    if quick:
        return cases
    return cases + [
        ("group 8-bit", triton_group._step_group_kernel, _GROUP_TYPES, _STEP),
        ("group 6+2+4 amsgrad seeded bf16", triton_group._step_group_kernel, {**_GROUP_TYPES, **bf16},
         dict(_STEP, BLOCK=128, ROWS=16, M_BITS=6, V_BITS=2, X_BITS=4, AMSGRAD=True, STOCHASTIC=True)),
        ("group 4+4 unaligned", triton_group._step_group_kernel, _GROUP_TYPES,
         dict(_STEP, BLOCK=128, ROWS=16, M_BITS=4, V_BITS=4, ALIGNED=False)),
        ("group 2+2 rows of <= 32", triton_group._step_group_kernel, _GROUP_TYPES,
         dict(_STEP, BLOCK=32, ROWS=64, M_BITS=2, V_BITS=2)),
        ("dense group amsgrad bf16", triton_group._dense_group_kernel, {**_GROUP_TYPES, **bf16},
         dict(_DENSE, AMSGRAD=True)),
        ("step 4-bit seeded bf16", backend_triton._adam_kernel, {**_STEP_TYPES, "p_ptr": "*bf16", "g_ptr": "*bf16"},
         dict(_STEP, BLOCK=128, ROWS=16, M_BITS=4, V_BITS=4, STOCHASTIC=True)),
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
    options = {"enable_fp_fusion": False} if "STOCHASTIC" in constexprs or "TILE" in constexprs else {}
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one configuration of every kernel")
    parser.add_argument("--arch", type=int, action="append", help="compute capability, e.g. 80 or 90 (repeatable; "
                        "default 90)")
    args = parser.parse_args()
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
