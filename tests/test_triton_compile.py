"""The Triton kernels compiled for an H100/H200 (sm_90) without a GPU, in a subprocess without
TRITON_INTERPRET (``tools/triton_compile_check.py --quick``): what the interpreter cannot check, that the
grouped kernels compile, keep the contract's rounding (no FMA, IEEE div/sqrt) and vectorize aligned rows.
"""

import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="this Triton build ships no ptxas to compile for CUDA")
def test_grouped_kernels_compile_for_sm90_exact_and_vectorized():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences Triton 3.9's notice; the kernels set their own
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "triton_compile_check.py"), "--quick"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "| group 8-bit |" in done.stdout and "| dense group |" in done.stdout
