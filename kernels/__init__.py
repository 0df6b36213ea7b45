"""Triton kernels for ckptq, installed as ``ckptq.kernels``: import them as ``from ckptq.kernels import quant``.

Nothing here imports triton at package import, so ``import ckptq`` keeps working without it; the
submodules import triton themselves and are only loaded on the ``backend="triton"`` path.
"""
