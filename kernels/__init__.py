"""The backend implementations of ckptq's operations, installed as ``ckptq.kernels``.

``ckptq.codec.ops`` declares the operations and dispatches to one of: ``backend_torch`` (the PyTorch
reference), ``backend_native`` (the C CPU kernels in ``cpu_kernels.c``, built and loaded by ``native``)
and ``backend_triton`` (the Triton CUDA kernels). ``contract`` states what they take; ``lut`` and
``cpu_runtime`` are shared by the CPU backends. Nothing here imports from ``ckptq`` above it, and nothing
imports triton at package import: only ``backend_triton`` does, on the ``backend="triton"`` path.

Imported under any other name than ``ckptq.kernels``, this folder is being found by accident: Python was
started in a checkout of ckptq (``python -m ...``, ``python -c ...`` put the working directory first on
``sys.path``) and something imported a top-level ``kernels``, such as Hugging Face's ``kernels`` package that
transformers imports. The import is then handed to the installed package of that name, as if the checkout
were not on the path (and fails as it would without this folder when there is none).
"""

if __name__ != "ckptq.kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    def _installed_spec(name: str):
        """The spec the import system finds for ``name`` with this checkout taken off ``sys.path``."""
        checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = [p for p in sys.path if os.path.abspath(p or os.curdir) != checkout]
        for finder in sys.meta_path:
            if finder is importlib.machinery.PathFinder:
                spec = finder.find_spec(name, path)
            elif hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, None)
            else:
                continue
            if spec is not None and spec.origin != os.path.abspath(__file__):
                return spec
        return None

    _spec = _installed_spec(__name__)
    if _spec is None:
        raise ModuleNotFoundError(
            f"No module named {__name__!r} (the folder {os.path.dirname(os.path.abspath(__file__))} is ckptq's "
            "kernels, importable only as ckptq.kernels)", name=__name__)
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[__name__] = _module  # the import statement returns what sys.modules holds after this file
    _spec.loader.exec_module(_module)
