"""The Triton kernels compiled for an A100 (sm_80) and an H100/H200 (sm_90) without a GPU, in a subprocess
without TRITON_INTERPRET (``tools/scripts/triton_compile_check.py --quick``, one configuration of every kernel):
what the interpreter cannot check, that every kernel compiles for both, keeps the contract's rounding (no
FMA or approximate ops, IEEE div/sqrt), vectorizes aligned rows and spills nothing (no stack frame, no
local memory), with its registers reported. About 25 s. And the one step's template with the momentum rule
(SGD, Lion, Muon) at the configurations the one-state step uses.
"""

import os
import re
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT

triton = pytest.importorskip("triton")
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
KERNELS = ("step adam 4-bit seeded", "step rmsprop heavy centered 8-bit", "dense adam", "quantize 8-bit sqrt",
           "dequantize 6-bit")
ROW = re.compile(r"^\| (?P<name>[^|]+) \| (?P<regs>\d+) \| (?P<stack>\d+) \| (?P<local>\d+) \| (?P<fma>\d+) \| "
                 r"(?P<approx>\d+) \| (?P<div>\d+) \| (?P<sqrt>\d+) \| (?P<v4>\d+) \|$")


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="this Triton build ships no ptxas to compile for CUDA")
def test_every_kernel_compiles_for_sm80_and_sm90_exact_vectorized_and_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences Triton 3.9's notice; the kernels set their own
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "scripts", "triton_compile_check.py"), "--quick",
                           "--arch", "80", "--arch", "90"], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    sections = done.stdout.split("\nsm_")[1:]
    assert [s.split("\n", 1)[0] for s in sections] == ["80", "90"]
    for section in sections:
        rows = {m["name"]: m for m in map(ROW.match, section.splitlines()) if m}
        assert set(rows) == set(KERNELS), section
        for name, row in rows.items():
            assert int(row["regs"]) > 0 and row["stack"] == row["local"] == "0", row.group(0)
            if "quantize" not in name:
                assert row["fma"] == row["approx"] == "0" and int(row["div"]) > 0 and int(row["sqrt"]) > 0, row.group(0)


_COMPILE = """
import sys
import triton_compile_check as t  # clears TRITON_INTERPRET before importing triton
from ckptq.kernels import triton_step
types = {**t._STEP_TYPES, "p_like": "*bf16"}
cases = [("sgd 8-bit seeded", t.step_constexprs("momentum", 2, (t._slot(8, stochastic=True),))),
         ("lion 4-bit maximize seeded", t.step_constexprs("momentum", 5, (t._slot(4, stochastic=True),), 128)),
         ("muon 6-bit unaligned", t.step_constexprs("momentum", 0, (t._slot(6),), 64, aligned=False))]
failures = []
for name, constexprs in cases:
    r = t.compile_case(triton_step._step_kernel, types, constexprs, 90)
    print(name, r)
    failures += t.check(name, constexprs, r) + ([name + ": no IEEE division"] if r["div.rn"] == 0 else [])
print(*failures, sep="\\n")
sys.exit(1 if failures else 0)
"""


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="this Triton build ships no ptxas to compile for CUDA")
def test_the_momentum_step_compiles_for_sm90_exact_and_without_spills():
    """What the interpreter cannot check (tools/scripts/triton_compile_check.py): the one step's template with the
    momentum rule (SGD, Lion, Muon) compiles for an H100/H200, with no FMA or approximate op, IEEE division,
    no spills, 128-bit loads where aligned."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "tools" / "scripts")  # the child imports triton_compile_check from there
    done = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
