"""Compile the Triton kernels for a GPU without one (triton.compile with a GPUTarget; ptxas ships with
Triton) and check what the interpreter cannot: that they compile at all, that the step's arithmetic is
the contract's (no FMA, IEEE ``div.rn`` / ``sqrt.rn``), and that aligned layouts get 128-bit loads.
Prints registers, spills and instruction counts per kernel; exits 1 if a check fails.

    python tools/triton_compile_check.py [--quick] [--arch 90]

Run without TRITON_INTERPRET (it is cleared here before triton is imported).
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


def _cases(quick: bool) -> list[tuple]:
    """(name, kernel, arg types, constexprs): the grouped kernels first (the quick set)."""
    bf16 = {"p_like": "*bf16", "g_like": "*bf16"}
    cases = [("group 8-bit", triton_group._step_group_kernel, _GROUP_TYPES, _STEP),
             ("dense group", triton_group._dense_group_kernel, _GROUP_TYPES, _DENSE)]
    if quick:
        return cases
    return cases + [
        ("group 6+2+4 amsgrad seeded bf16", triton_group._step_group_kernel, {**_GROUP_TYPES, **bf16},
         dict(_STEP, BLOCK=128, ROWS=16, M_BITS=6, V_BITS=2, X_BITS=4, AMSGRAD=True, STOCHASTIC=True)),
        ("group 4+4 unaligned", triton_group._step_group_kernel, _GROUP_TYPES,
         dict(_STEP, BLOCK=128, ROWS=16, M_BITS=4, V_BITS=4, ALIGNED=False)),
        ("group 2+2 rows of <= 32", triton_group._step_group_kernel, _GROUP_TYPES,
         dict(_STEP, BLOCK=32, ROWS=64, M_BITS=2, V_BITS=2)),
        ("dense group amsgrad bf16", triton_group._dense_group_kernel, {**_GROUP_TYPES, **bf16},
         dict(_DENSE, AMSGRAD=True)),
        ("step 8-bit", backend_triton._adam_kernel, _STEP_TYPES, _STEP),
        ("step 4-bit seeded bf16", backend_triton._adam_kernel, {**_STEP_TYPES, "p_ptr": "*bf16", "g_ptr": "*bf16"},
         dict(_STEP, BLOCK=128, ROWS=16, M_BITS=4, V_BITS=4, STOCHASTIC=True)),
        ("quantize 8-bit sqrt", backend_triton._quantize_kernel, {"codes_ptr": "*u8", "n_blocks": "i64", "row_len": "i64"},
         dict(BLOCK=256, ROWS=8, SQRT=True, BITS=8, ALIGNED=True)),
        ("dequantize 6-bit", backend_triton._dequantize_kernel, {"codes_ptr": "*u8", "n_blocks": "i64", "row_len": "i64"},
         dict(BLOCK=256, ROWS=8, SQRT=False, BITS=6, ALIGNED=True)),
    ]


def _resources(cubin: bytes) -> tuple[str, str]:
    """(registers, stack bytes) from cuobjdump, or ('?', '?') where it is not at hand."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return "?", "?"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+).*?STACK:(\d+)", out, re.S)
    return found.groups() if found else ("?", "?")


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
    regs, stack = _resources(compiled.asm["cubin"])
    count = lambda pattern: len(re.findall(pattern, ptx))  # noqa: E731
    return {"regs": regs, "stack": stack, "fma": count(r"\bfma\.rn\.f32"), "approx": count(r"\.approx\.f32"),
            "div.rn": count(r"\bdiv\.rn\.f32"), "sqrt.rn": count(r"\bsqrt\.rn\.f32"), "v4 loads": count(r"ld\.global[.a-z0-9]*\.v4")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the grouped kernels only")
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80 or 90")
    args = parser.parse_args()
    failures = []
    print("| kernel | regs | stack | fma | approx | div.rn | sqrt.rn | v4 loads |\n|---|--:|--:|--:|--:|--:|--:|--:|")
    for name, kernel, types, constexprs in _cases(args.quick):
        r = compile_case(kernel, types, constexprs, args.arch)
        print(f"| {name} | {r['regs']} | {r['stack']} | {r['fma']} | {r['approx']} | {r['div.rn']} | {r['sqrt.rn']} | "
              f"{r['v4 loads']} |")
        exact = "quantize" in name or "dequantize" in name or (r["fma"] == 0 and r["approx"] == 0)
        if not exact:
            failures.append(f"{name}: {r['fma']} FMA / {r['approx']} approximate ops break the contract's rounding")
        if constexprs.get("ALIGNED") and "dequantize" not in name and r["v4 loads"] == 0:
            failures.append(f"{name}: aligned, but no 128-bit loads")
    for failure in failures:
        print("FAILED", failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
