"""Safetensors checkpoints: atomic, hashed, owner-only writes; validated, zero-copy reads.

Reads never unpickle and never trust the file: the header is parsed and checked (size bounds,
dtypes, shapes against byte ranges, ranges inside the file) before any tensor is touched, and
tensors are handed out as views of a private memory map, so a push reads each byte once, from
the page cache straight into the engine's storage. Writes go to a temporary file in the target
directory and are renamed into place, so a reader never sees a partial file and a file an engine
has mapped is never overwritten in place.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import struct
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .layout import TensorSpec

__all__ = [
    "HASH_KEY",
    "CheckpointError",
    "CheckpointReader",
    "SavedCheckpoint",
    "resolve_checkpoint_files",
    "save_checkpoint",
]

HASH_KEY = "weight_bridge.blake3"
INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit

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


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used; names the file, the tensor and the problem."""

    def __init__(self, path: str | os.PathLike, problem: str, tensor: str | None = None):
        self.path = str(path)
        self.tensor = tensor
        self.problem = problem
        where = f"{self.path}: tensor {tensor!r}: " if tensor else f"{self.path}: "
        super().__init__(where + problem)


@dataclass(frozen=True)
class _Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass
class _File:
    path: Path
    size: int
    data_start: int
    metadata: dict[str, str]
    entries: dict[str, _Entry]


def _parse_header(path: Path) -> _File:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(path, f"not a safetensors file: {size} bytes is too short")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(
                    path, f"not a safetensors file: header size {n} exceeds {MAX_HEADER_BYTES}"
                )
            if 8 + n > size:
                raise CheckpointError(
                    path, f"truncated: header of {n} bytes but file has {size - 8} after its length"
                )
            raw = f.read(n)
    except OSError as exc:
        raise CheckpointError(path, f"cannot read: {exc.strerror or exc}") from exc
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(path, f"corrupt header: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(path, "corrupt header: not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise CheckpointError(path, "corrupt header: __metadata__ must map strings to strings")
    data_start = 8 + n
    data_size = size - data_start
    entries: dict[str, _Entry] = {}
    for name, info in header.items():
        entries[name] = _parse_entry(path, name, info, data_size)
    spans = sorted((e.begin, e.end, name) for name, e in entries.items() if e.end > e.begin)
    for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:], strict=False):
        if b1 < e0:
            raise CheckpointError(path, f"byte range overlaps tensor {n0!r}", n1)
    return _File(path, size, data_start, metadata, entries)


def _parse_entry(path: Path, name: str, info: object, data_size: int) -> _Entry:
    if not isinstance(info, dict):
        raise CheckpointError(path, "corrupt header entry", name)
    dtype = DTYPES.get(info.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise CheckpointError(path, f"unsupported dtype {info.get('dtype')!r}", name)
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise CheckpointError(path, f"invalid shape {shape!r}", name)
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and o >= 0 for o in offsets)
        or offsets[1] < offsets[0]
    ):
        raise CheckpointError(path, f"invalid data_offsets {offsets!r}", name)
    begin, end = offsets
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise CheckpointError(
            path, f"byte range of {end - begin} bytes does not fit shape {shape} {dtype}", name
        )
    if end > data_size:
        raise CheckpointError(
            path, f"truncated: data ends at byte {end} but the file holds {data_size}", name
        )
    return _Entry(dtype, tuple(shape), begin, end)


def resolve_checkpoint_files(checkpoint: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint: one file, or a directory (index json honoured).

    Paths named by an index must stay inside the checkpoint's directory.
    """
    path = Path(checkpoint)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise CheckpointError(path, "no such checkpoint file or directory")
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(index, f"corrupt shard index: {exc}") from exc
        root = path.resolve()
        files = []
        for name in names:
            if not isinstance(name, str):
                raise CheckpointError(index, f"shard name {name!r} is not a string")
            shard = (path / name).resolve()
            if shard.parent != root and root not in shard.parents:
                raise CheckpointError(index, f"shard path {name!r} escapes {root}")
            if not shard.is_file():
                raise CheckpointError(index, f"shard {name!r} does not exist")
            files.append(shard)
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(path, "directory holds no .safetensors file")
    return files


class CheckpointReader:
    """A validated, memory-mapped safetensors checkpoint (a file or a sharded directory).

    Opening parses and checks every header; :meth:`tensors` yields zero-copy views in file
    order. Keep the reader alive while the views are in use.
    """

    def __init__(self, checkpoint: str | os.PathLike):
        self.path = Path(checkpoint)
        self.files = [_parse_header(p) for p in resolve_checkpoint_files(checkpoint)]
        self._where: dict[str, _File] = {}
        for f in self.files:
            for name in f.entries:
                if name in self._where:
                    raise CheckpointError(
                        f.path, f"also stored in {self._where[name].path.name}", name
                    )
                self._where[name] = f
        self._maps: dict[Path, mmap.mmap] = {}

    @property
    def metadata(self) -> dict[str, str]:
        return dict(self.files[0].metadata) if self.files else {}

    @property
    def nbytes(self) -> int:
        return sum(e.end - e.begin for f in self.files for e in f.entries.values())

    def specs(self) -> dict[str, TensorSpec]:
        """Name -> shape, dtype of every tensor, from the headers alone."""
        return {
            name: TensorSpec(e.shape, e.dtype) for f in self.files for name, e in f.entries.items()
        }

    def _map(self, f: _File) -> mmap.mmap:
        m = self._maps.get(f.path)
        if m is None:
            with open(f.path, "rb") as fh:
                # ACCESS_COPY: a private mapping, writable from Python's side, so torch can wrap it
                # without a read-only warning; nothing is ever written back to the file.
                m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
            if len(m) != f.size:
                raise CheckpointError(f.path, "file changed size while being opened")
            self._maps[f.path] = m
        return m

    def tensor(self, name: str) -> torch.Tensor:
        f = self._where.get(name)
        if f is None:
            raise CheckpointError(self.path, "no such tensor", name)
        e = f.entries[name]
        if e.end == e.begin:
            return torch.empty(e.shape, dtype=e.dtype)
        raw = torch.frombuffer(
            self._map(f), dtype=torch.uint8, count=e.end - e.begin, offset=f.data_start + e.begin
        )
        return raw.view(e.dtype).view(e.shape)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor as ``(name, view)``, in the order the bytes lie in the files."""
        for f in self.files:
            for name, _ in sorted(f.entries.items(), key=lambda kv: kv[1].begin):
                yield name, self.tensor(name)

    def verify_hash(self) -> None:
        """Recompute the content hash written by :func:`save_checkpoint`; raise if it differs."""
        for f in self.files:
            want = f.metadata.get(HASH_KEY)
            if want is None:
                raise CheckpointError(f.path, f"no content hash ({HASH_KEY}) in the header")
            m = self._map(f)
            got = _hash(memoryview(m)[f.data_start :])
            if got != want:
                raise CheckpointError(
                    f.path, "content hash mismatch: the file was changed or torn after it was saved"
                )

    def close(self) -> None:
        self._maps.clear()  # mappings close when the last view of them is gone

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _hash(data: memoryview | bytes) -> str:
    import blake3

    return blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest()


def _bytes_of(t: torch.Tensor) -> memoryview:
    flat = t.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


def _write_all(f, data: memoryview) -> None:
    data = data.cast("B")
    while data:
        n = f.write(data)
        data = data[n:]


@dataclass(frozen=True)
class SavedCheckpoint:
    """A checkpoint written by :func:`save_checkpoint`."""

    path: Path
    bytes: int
    hash: str
    elapsed_s: float


def save_checkpoint(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    metadata: Mapping[str, str] | None = None,
    fsync: bool = True,
) -> SavedCheckpoint:
    """Write ``tensors`` as one safetensors file at ``path``, atomically, owner-only.

    The header carries ``metadata`` plus a blake3 hash of the data section, so a push can tell a
    swapped or torn file. Tensors must not share storage (write tied weights once).
    """
    started = time.perf_counter()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ptrs: dict[tuple[int, int], str] = {}
    header: dict[str, object] = {}
    offset = 0
    cpu: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if t.dtype not in DTYPE_NAMES:
            raise CheckpointError(path, f"dtype {t.dtype} has no safetensors name", name)
        t = t.detach().to("cpu")
        if t.numel():
            key = (t.untyped_storage().data_ptr(), int(t.storage_offset()))
            if key in ptrs:
                raise CheckpointError(
                    path, f"shares storage with {ptrs[key]!r}; write it once", name
                )
            ptrs[key] = name
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
        cpu[name] = t
    import blake3

    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for t in cpu.values():
        if t.numel():
            h.update(_bytes_of(t))
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    meta[HASH_KEY] = h.hexdigest()
    header["__metadata__"] = meta
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # align the data section to 8 bytes
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb", buffering=0) as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for t in cpu.values():
                if t.numel():
                    _write_all(f, _bytes_of(t))
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return SavedCheckpoint(path, offset, meta[HASH_KEY], time.perf_counter() - started)
