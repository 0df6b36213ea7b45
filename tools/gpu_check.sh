#!/usr/bin/env bash
# The GPU checks, as one script for a machine with CUDA (run from the repo root, ~5 minutes):
#   1. every Triton kernel on CUDA against the PyTorch reference on the CPU (bit for bit),
#      and convert with the kernels writing the same bytes as the CPU path;
#   2. the fused 8-bit AdamW step's memory bandwidth vs torch fused AdamW and bitsandbytes;
#   3. convert of a 2 GB checkpoint quantizing on the GPU, vs the I/O floor;
#   4. FSDP2 + AdamW8bit on the GPU (Triton on DTensor shards, NCCL) through a DCP save and resume.
# Figures go to $OUT (or ./gpu_results) for the README and the issue notes.
set -euo pipefail
out="${OUT:-gpu_results}"
mkdir -p "$out"
python -m pip install -q torch triton >/dev/null 2>&1 || true  # the device image brings CUDA torch
python -m pip install -q -e '.[test,bench]' >/dev/null
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())" | tee "$out/device.txt"
python -m pytest -q tests/test_kernels_quant.py tests/test_kernels_adam.py tests/test_end_to_end.py 2>&1 | tail -5 | tee "$out/kernels.txt"
python tools/bench_optim.py --gpu 2>&1 | tail -12 | tee "$out/bench_optim_gpu.md"
python tools/bench_io.py --size-gb 2 --rounds 2 --device cuda --dir /tmp/ckptq_bench 2>&1 | tail -8 | tee "$out/bench_io_cuda.md"
# 4. FSDP2 on the GPU: the Triton step on DTensor shards over NCCL, through a DCP save and resume
python -m torch.distributed.run --standalone --nproc-per-node "$(python -c 'import torch; print(min(torch.cuda.device_count(), 2))')" \
  tools/gpu_fsdp_check.py 2>&1 | grep -v '^W' | tail -3 | tee "$out/fsdp_gpu.txt"
