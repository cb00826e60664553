"""The header a writer plans from metadata alone, before any tensor exists: each tensor's byte
range, the encoded header (8-byte aligned, a placeholder for the content hash) and where in the
file the hash's hex digits go once the data is written."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from .errors import CheckpointError
from .format import DTYPE_NAMES, HASH_KEY


class TensorMeta(Protocol):
    """What the header needs of a tensor: a ``torch.Tensor``, a meta tensor, a ``TensorSpec``."""

    @property
    def shape(self) -> torch.Size | tuple[int, ...]: ...

    @property
    def dtype(self) -> torch.dtype: ...


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor's place in the file: its shape, dtype and byte range in the data section."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    begin: int
    end: int


def plan_header(
    path: Path,
    specs: Iterable[tuple[str, TensorMeta]],
    metadata: Mapping[str, str] | None,
    hashed: bool = True,
) -> tuple[dict[str, PlannedTensor], bytes, int | None]:
    """Each tensor's byte range, the encoded header (hash placeholder, 8-byte aligned) and
    where in the file the hash's 64 hex digits go."""
    planned: dict[str, PlannedTensor] = {}
    header: dict[str, object] = {}
    offset = 0
    for name, spec in specs:
        if name in planned:
            raise CheckpointError(path, "named twice", name)
        if name == "__metadata__":
            raise CheckpointError(path, "reserved name", name)
        if spec.dtype not in DTYPE_NAMES:
            raise CheckpointError(path, f"dtype {spec.dtype} has no safetensors name", name)
        shape = tuple(int(s) for s in spec.shape)
        n = math.prod(shape) * spec.dtype.itemsize
        planned[name] = PlannedTensor(shape, spec.dtype, offset, offset + n)
        header[name] = {
            "dtype": DTYPE_NAMES[spec.dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    meta.pop(HASH_KEY, None)
    if hashed:
        meta[HASH_KEY] = "0" * 64
    header["__metadata__"] = meta
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # align the data section to 8 bytes
    if not hashed:
        return planned, struct.pack("<Q", len(raw)) + raw, None
    marker = json.dumps({HASH_KEY: meta[HASH_KEY]}, separators=(",", ":"))[1:-1].encode()
    hash_at = 8 + raw.index(marker) + len(marker) - 65
    return planned, struct.pack("<Q", len(raw)) + raw, hash_at
