"""The backend implementations of ckptq's operations, installed as ``ckptq.kernels``.

``ckptq.ops`` declares the operations and dispatches to one of: ``backend_torch`` (the PyTorch
reference), ``backend_native`` (the C CPU kernels in ``cpu_kernels.c``, built and loaded by ``native``)
and ``backend_triton`` (the Triton CUDA kernels). ``contract`` states what they take; ``lut`` and
``cpu_runtime`` are shared by the CPU backends. Nothing here imports from ``ckptq`` above it, and nothing
imports triton at package import: only ``backend_triton`` does, on the ``backend="triton"`` path.
"""
