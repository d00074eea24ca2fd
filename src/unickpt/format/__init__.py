"""The on-disk format: metadata types, versioning and their (de)serialization. No pickle."""

from .metadata import (
    FORMAT_NAME,
    FORMAT_VERSION,
    ChunkMeta,
    CommitRecord,
    FileRef,
    Metadata,
    TensorMeta,
)

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "ChunkMeta",
    "CommitRecord",
    "FileRef",
    "Metadata",
    "TensorMeta",
]
