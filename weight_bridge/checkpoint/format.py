"""What readers and the writer agree on: dtype names, size limits, file names, the content hash."""

from __future__ import annotations

import os

import torch

HASH_KEY = "weight_bridge.blake3"
# A checkpoint whose metadata names a base version is *partial*: it holds only some tensors and
# applies on top of exactly that version (see ColocatedEngine.push).
BASE_VERSION_KEY = "base_version"
VERSION_KEY = "version"  # the metadata entry naming the weights' version
INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit
MAX_INDEX_BYTES = 100 * 1024 * 1024


def version_of(path: str, metadata_version: str | None = None) -> str:
    """The project's one default version rule: a checkpoint's version is its ``version``
    metadata, else its file name without ``.safetensors`` (a directory of shards: the
    directory's name). The engine stamps it when an update names no version; a trainer that
    names none predicts the label with the same function."""
    if metadata_version is not None:
        return str(metadata_version)
    return os.path.basename(os.path.normpath(path)).removesuffix(".safetensors")


DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

# First bytes of formats that are refused by name (never loaded): torch.save's zip archive and
# its legacy pickle stream, a bare pickle (protocol 2 to 5), numpy's .npy.
FOREIGN_MAGIC: list[tuple[bytes, str]] = [
    (b"PK\x03\x04", "a zip archive (the format of torch.save)"),
    (b"PK\x05\x06", "an empty zip archive"),
    (b"\x93NUMPY", "a numpy .npy array"),
    (b"GGUF", "a GGUF file"),
] + [
    (bytes([0x80, p]), f"a Python pickle (protocol {p}), e.g. torch.save's legacy format")
    for p in range(2, 6)
]


def content_hash(data: memoryview | bytes) -> str:
    """The blake3 hex digest of a data section, as stored under :data:`HASH_KEY`."""
    import blake3

    return blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest()
