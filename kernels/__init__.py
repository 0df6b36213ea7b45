"""Kernels for ckptq, installed as ``ckptq.kernels``: import them as ``from ckptq.kernels import quant``.

``quant`` and ``adam8bit`` are the Triton (CUDA) kernels; ``cpu_kernels.c`` the C CPU kernels, built and
loaded by ``native``. Nothing here imports triton at package import, so ``import ckptq`` keeps working
without it; the Triton submodules import it themselves and are only loaded on the ``backend="triton"`` path.
"""
