"""The ckptq file format at the byte level (spec: docs/FORMAT.md): safetensors files and shard sets with
their index (``container``, ``safetensors_io``, ``reader``, ``index``), checksums (``integrity``), the
optional zstd stage (``compress``), atomic outputs (``files``), torch.save streaming (``torch_stream``) and
the one dtype table (``dtypes``). Nothing here knows about codecs or kernels: the skeleton is opaque JSON
at this level (``ckptq.codec.tree`` encodes and decodes it).

The names below are looked up on first use (PEP 562): importing one submodule imports only what it needs.
"""

from .. import lazy_attributes

_NAMES = {"Compression": "container", "Container": "container", "FORMAT_VERSION": "container",
          "READS_VERSIONS": "container", "is_safetensors": "container", "planned_bytes": "container",
          "write": "container", "atomic_outputs": "atomic", "INDEX_SUFFIX": "index", "SUFFIX": "index"}
__all__ = sorted(_NAMES)

__getattr__ = lazy_attributes(__name__, _NAMES)
