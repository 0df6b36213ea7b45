"""Make the small real DeepSpeed ZeRO checkpoints under tests/fixtures/zero/ (needs deepspeed; CPU, 2
processes over gloo, about 20 s each):

    python tools/scripts/make_zero_fixtures.py [--out tests/fixtures/zero]

zero1/, zero2/, zero3/ (fp32) and zero2_bf16/ (bf16 training: ``bf16_`` rank files): a DeepSpeed save
dir each (``latest`` + ``global_step3/``) of a 1,928-parameter MLP after 3 AdamW steps on 2 ranks, and
zero2/global_step3_universal/ (that step converted by DeepSpeed's ``ds_to_universal``, with its
``latest_universal``). DeepSpeed's copies of
``zero_to_fp32.py`` / ``zero_to_torch.py`` are left out. tests/deepspeed/test_zero.py reads these files without
DeepSpeed installed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "..", "tests", "fixtures", "zero"))
    return ap


if __name__ == "__main__":
    build_parser().parse_args()  # --help and usage errors answer here, before torch and ckptq load

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_worker import launch  # noqa: E402

CASES = {"zero1": ["--stage", "1"], "zero2": ["--stage", "2"], "zero3": ["--stage", "3"],
         "zero2_bf16": ["--stage", "2", "--bf16"]}


def universal(src_step: str, dst: str) -> None:
    """DeepSpeed's own ds_to_universal of one global_stepN folder into ``dst``."""
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", src_step,
           "--output_folder", dst, "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    if r.returncode:
        raise RuntimeError(f"ds_to_universal failed:\n{(r.stdout + r.stderr)[-3000:]}")


def main() -> None:
    args = build_parser().parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in CASES.items():
            save = os.path.join(tmp, name)
            launch(*extra, "--steps", "3", "--save-at", "3", "--save-dir", save, "--losses", os.path.join(tmp, "l.json"))
            for script in ("zero_to_fp32.py", "zero_to_torch.py"):
                if os.path.exists(os.path.join(save, script)):
                    os.unlink(os.path.join(save, script))
            shutil.rmtree(os.path.join(args.out, name), ignore_errors=True)
            shutil.copytree(save, os.path.join(args.out, name))
            print(f"{name}: {sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(save) for f in fs):,} bytes")
        dst = os.path.join(args.out, "zero2", "global_step3_universal")
        universal(os.path.join(args.out, "zero2", "global_step3"), dst)
        print(f"zero2/global_step3_universal: {sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(dst) for f in fs):,} bytes")


if __name__ == "__main__":
    main()
