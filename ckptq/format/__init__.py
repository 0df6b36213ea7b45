"""The ckptq file format at the byte level (spec: docs/FORMAT.md): safetensors files and shard sets with
their index, checksums, the optional zstd stage, atomic outputs, torch.save streaming and the one dtype
table. Nothing here knows about codecs or kernels: the skeleton is opaque JSON at this level
(``ckptq.codec.tree`` encodes and decodes it)."""

from .container import (Compression, Container, FORMAT_VERSION, READS_VERSIONS, is_safetensors, parse_size,
                        planned_bytes, write)
from .files import atomic_outputs
from .index import INDEX_SUFFIX, SUFFIX

__all__ = ["Compression", "Container", "FORMAT_VERSION", "READS_VERSIONS", "INDEX_SUFFIX", "SUFFIX",
           "atomic_outputs", "is_safetensors", "parse_size", "planned_bytes", "write"]
