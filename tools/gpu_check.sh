#!/usr/bin/env bash
# The GPU checks, as one script for a machine with CUDA (run from the repo root, ~8 minutes):
#   1. every Triton kernel (8, 6, 4 and 2 bits) on CUDA against the PyTorch reference, bit for bit,
#      and convert with the kernels writing the same bytes as the CPU path; the row layout, the grouped
#      steps (one launch per group), a grouped step captured in a CUDA graph replaying as the eager one,
#      and no step waiting for the device (tests/test_triton_{rows,group,cuda}.py);
#   2. the fused AdamW step (8 and 4 bits) vs torch fused AdamW (and bitsandbytes where installed);
#   3. convert of a 1 GB checkpoint quantizing on the GPU, vs the I/O floor;
#   4. FSDP2 + AdamW8bit on the GPU (Triton on DTensor shards, NCCL) through a DCP save and resume;
#   5. the grouped kernels alone (tools/bench_triton.py): ms and GB/s against the bytes the update must
#      move (16.1 B/param at 8 bits), torch fused AdamW and a device copy in the same run, a CUDA-graph
#      replay, and a sweep of tile sizes x warps; registers and spills of each kernel on this GPU's arch.
# Works offline: the package runs from the tree (ckptq.kernels linked to kernels/), and wheels the
# image lacks (zstandard) come from .whl/ if present. Figures go to $OUT (or ./gpu_results); the exit
# status is the kernel tests' (kernels_full.txt holds their failures in full).
set -uo pipefail
out="${OUT:-gpu_results}"
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -c "import ckptq" 2>/dev/null || { ln -sfn ../kernels ckptq/kernels; export PYTHONPATH="$PWD:${PYTHONPATH:-}"; }
export PYTHONUNBUFFERED=1
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" | tee "$out/device.txt"
python3 -m pytest -q -p no:cacheprovider --tb=short -rf tests/test_kernels_quant.py tests/test_kernels_adam.py \
  tests/test_fourbit_kernels.py tests/test_end_to_end.py tests/test_triton_rows.py tests/test_triton_group.py \
  tests/test_triton_cuda.py > "$out/kernels_full.txt" 2>&1
tests_rc=$?
tail -8 "$out/kernels_full.txt" | tee "$out/kernels.txt"
arch="$(python3 -c 'import torch; print("%d%d" % torch.cuda.get_device_capability())')"
timeout 300 python3 tools/triton_compile_check.py --arch "$arch" 2>&1 | grep -v -i warn | tee "$out/triton_compile.md"
timeout 420 python3 tools/bench_triton.py --rounds 20 --sweep 2>&1 | tee "$out/bench_triton.md"
for layout in many-small gpt2-124m llama-1b; do
  timeout 240 python3 tools/bench_optim.py --gpu --layout "$layout" --rounds 7 --only torch-fused,bnb,ckptq,ckptq4 2>&1 \
    | tail -12 | tee "$out/bench_optim_gpu_$layout.md"
done
python3 tools/bench_io.py --size-gb 1 --rounds 2 --no-compress --device cuda --dir /tmp/ckptq_bench 2>&1 | tail -8 | tee "$out/bench_io_cuda.md"
python3 -m torch.distributed.run --standalone --nproc-per-node "$(python3 -c 'import torch; print(min(torch.cuda.device_count(), 2))')" \
  tools/gpu_fsdp_check.py 2>&1 | grep -v '^W' | tail -3 | tee "$out/fsdp_gpu.txt"
exit $tests_rc
