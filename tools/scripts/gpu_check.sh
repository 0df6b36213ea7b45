#!/usr/bin/env bash
# The GPU checks as one prepared run, for a machine with CUDA (run from the repo root; ~8 minutes on an
# H200, every part under its own time limit and all of them within GPU_CHECK_BUDGET seconds, default 540,
# so that one call of at most 10 minutes holds it). Parts, most important first (GPU_CHECK_PARTS selects,
# e.g. GPU_CHECK_PARTS="tests compile" for a first call and "optim triton io fsdp" for a second):
#   tests    every Triton kernel (8, 6, 4, 2 bits) on CUDA against the PyTorch reference, bit for bit;
#            convert writing the CPU path's bytes; the row layout; the grouped steps; a grouped step and an
#            AdamW8bit/4bit(capturable=True).step() captured in a CUDA graph replaying as their eager twins
#            (and as capturable=False) bit for bit; no capturable step waiting for the device
#            (tests/kernels/test_quantize.py, test_step*.py, test_triton_cuda.py, tests/optim/test_capturable.py, ...)
#   compile  every kernel compiled for this GPU's arch: registers, no spills, no FMA (triton_compile_check)
#   optim    the grouped step vs torch fused AdamW on gpt2-124m and llama-1b shapes, eager and CUDA-graph
#            replays of both, bitsandbytes beside them (tools/bench/optim.py --gpu)
#   triton   the grouped kernels alone: ms and achieved GB/s vs a device copy (HBM bandwidth) and fused
#            (tools/bench/triton_steps.py)
#   io       convert of a 1 GB checkpoint quantizing on the GPU, vs the I/O floor (tools/bench/convert_io.py)
#   fsdp     FSDP2 + AdamW8bit on the GPU (Triton on DTensor shards, NCCL) through a DCP save and resume
# Works offline: the package runs from the tree (ckptq.kernels linked to kernels/), and wheels the image
# lacks (zstandard) come from .whl/ if present. Figures go to $OUT (or ./gpu_results), one file per part,
# and $OUT/summary.txt says which parts ran, passed, failed, timed out or were skipped for the budget. The
# exit status is 1 if the tests part failed, else 0.
set -uo pipefail
out="${OUT:-gpu_results}"
budget="${GPU_CHECK_BUDGET:-540}"
parts="${GPU_CHECK_PARTS:-tests compile optim triton io fsdp}"
mkdir -p "$out"
: > "$out/summary.txt"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -c "import ckptq" 2>/dev/null || { ln -sfn ../kernels ckptq/kernels; export PYTHONPATH="$PWD:${PYTHONPATH:-}"; }
export PYTHONUNBUFFERED=1
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" \
  | tee "$out/device.txt" || exit 2
arch="$(python3 -c 'import torch; print("%d%d" % torch.cuda.get_device_capability())')"
tests_rc=0

# part NAME LIMIT COMMAND...: runs COMMAND under `timeout LIMIT` (cut to the budget left), its output to
# $out/NAME.txt (tail shown), unless NAME is not selected or the budget cannot hold LIMIT's first minute.
part() {
  local name="$1" limit="$2"
  shift 2
  case " $parts " in *" $name "*) ;; *) return 0 ;; esac
  local left=$((budget - SECONDS))
  if [ "$left" -lt 60 ]; then
    echo "$name: skipped, ${left}s of the budget left" | tee -a "$out/summary.txt"
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit="$left"
  local start=$SECONDS rc
  timeout "$limit" bash -c '"$@"' _ "$@" > "$out/$name.txt" 2>&1  # bash: the command may be a function below
  rc=$?
  tail -15 "$out/$name.txt"
  local how="passed"
  [ "$rc" -ne 0 ] && how="failed (exit $rc)"
  [ "$rc" -eq 124 ] && how="timed out after ${limit}s"
  echo "$name: $how in $((SECONDS - start))s" | tee -a "$out/summary.txt"
  [ "$name" = tests ] && [ "$rc" -ne 0 ] && tests_rc=1
  return 0
}

optim_bench() {
  for layout in gpt2-124m llama-1b; do
    echo "## $layout"
    python3 tools/bench/optim.py --gpu --layout "$layout" --rounds 7 \
      --only torch-fused,torch-graph,bnb,ckptq,ckptq-cap,ckptq-graph,ckptq4 2>&1 | grep -v -i warn | tail -12
  done
}

fsdp_check() {
  python3 -m torch.distributed.run --standalone \
    --nproc-per-node "$(python3 -c 'import torch; print(min(torch.cuda.device_count(), 2))')" \
    tools/scripts/gpu_fsdp_check.py 2>&1 | grep -v '^W'
}

export -f optim_bench fsdp_check
# the kernel tests' Triton cases and the reference's (the C builds' cases, marked c_kernels, run in CI)
part tests 300 python3 -m pytest -q -p no:cacheprovider --tb=short -rf -m "not c_kernels" tests/kernels/test_quantize.py \
  tests/kernels/test_step.py tests/kernels/test_step_adam.py tests/kernels/test_step_momentum.py tests/kernels/test_step_group.py \
  tests/sources/test_end_to_end.py tests/kernels/test_triton_cuda.py tests/optim/test_capturable.py
part compile 90 python3 tools/scripts/triton_compile_check.py --quick --arch "$arch"
part optim 200 optim_bench
part triton 150 python3 tools/bench/triton_steps.py --layout gpt2-124m,llama-1b --rounds 20
part io 120 python3 tools/bench/convert_io.py --size-gb 1 --rounds 2 --no-compress --device cuda --dir /tmp/ckptq_bench
part fsdp 120 fsdp_check
cat "$out/summary.txt"
exit $tests_rc
