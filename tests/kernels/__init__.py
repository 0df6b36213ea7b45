"""The kernels (C, Triton, PyTorch reference) against each other, bit for bit, on every backend and SIMD path."""
