"""Safetensors checkpoints: atomic, hashed, owner-only writes; validated, zero-copy reads.

Reads never unpickle and never trust the file: the header is parsed and checked (size bounds,
dtypes, shapes against byte ranges, ranges inside the file, no duplicate names) before any
tensor is touched, and tensors are handed out as views of a private memory map, so a push reads
each byte once, from the page cache straight into the engine's storage. Each file is opened
once: its header is read from, and its map made of, the same open file, so a file renamed over
the path in between cannot pair one file's header with another's bytes. A file that is not
safetensors (a ``torch.save`` zip or pickle renamed, say) is refused by its first bytes.

Writes go to an owner-only (0600) temporary file in the target directory, locked while it is
written, and are renamed into place, so a reader never sees a partial file, a file an engine
has mapped is never overwritten in place, and a write that fails (disk full, file too large)
leaves the previous file untouched and removes its temporary file. The temporary file of a
writer that was killed (SIGKILL) is left behind, hidden, under a name no reader picks up; a
later save into the same directory removes it once its lock is free and it is a minute old.

Limitation: a file that another program truncates *in place* while an engine has it mapped
makes the engine's next read of the lost pages fault (SIGBUS); only rename-into-place writers
(like :func:`save_checkpoint`) are safe to run beside a push.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import mmap
import os
import re
import stat
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
    "CheckpointWriteError",
    "SavedCheckpoint",
    "resolve_checkpoint_files",
    "save_checkpoint",
]

HASH_KEY = "weight_bridge.blake3"
INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit
MAX_INDEX_BYTES = 100 * 1024 * 1024
STALE_TEMP_AGE_S = 60.0  # an unlocked temporary file this old belongs to a dead writer
_TEMP_NAME = re.compile(r"^\.(?P<target>.+)\.[a-z0-9_]{8}\.tmp$")  # mkstemp's 8 characters

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
_FOREIGN_MAGIC: list[tuple[bytes, str]] = [
    (b"PK\x03\x04", "a zip archive (the format of torch.save)"),
    (b"PK\x05\x06", "an empty zip archive"),
    (b"\x93NUMPY", "a numpy .npy array"),
    (b"GGUF", "a GGUF file"),
] + [
    (bytes([0x80, p]), f"a Python pickle (protocol {p}), e.g. torch.save's legacy format")
    for p in range(2, 6)
]


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used; names the file, the tensor and the problem."""

    def __init__(self, path: str | os.PathLike, problem: str, tensor: str | None = None):
        self.path = str(path)
        self.tensor = tensor
        self.problem = problem
        where = f"{self.path}: tensor {tensor!r}: " if tensor is not None else f"{self.path}: "
        super().__init__(where + problem)


class CheckpointWriteError(OSError):
    """Saving a checkpoint failed (disk full, file too large, I/O error).

    The file that was at the path before is untouched and the temporary file is removed.
    ``errno`` is the underlying error's.
    """

    def __init__(self, path: str | os.PathLike, problem: str, code: int | None = None):
        super().__init__(code, f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem


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
    map: mmap.mmap | None = None


class _DuplicateKey(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _is_int(x: object) -> bool:
    return type(x) is int  # not bool, which JSON true/false would give


def _pread_all(fd: int, n: int, offset: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = os.pread(fd, n - got, offset + got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _sniff(path: Path, head: bytes) -> None:
    for magic, what in _FOREIGN_MAGIC:
        if head.startswith(magic):
            raise CheckpointError(
                path, f"not a safetensors file: it is {what}; pickled formats are never loaded"
            )


def _open_file(path: Path) -> _File:
    """Open, validate and map one safetensors file; nothing but the header is read."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused just below).
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise CheckpointError(path, f"cannot open: {exc.strerror or exc}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(path, "not a regular file")
        size = st.st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            what = "an empty file" if size == 0 else f"{size} bytes is too short"
            raise CheckpointError(path, f"not a safetensors file: {what}")
        (n,) = struct.unpack("<Q", head)
        raw = b""
        if n > MAX_HEADER_BYTES:
            problem = f"not a safetensors file: header size {n} exceeds {MAX_HEADER_BYTES}"
        elif 8 + n > size:
            problem = f"truncated: header of {n} bytes but file has {size - 8} after its length"
        else:
            raw = _pread_all(fd, n, 8)
            problem = "" if raw.startswith(b"{") else "corrupt header: does not start with '{'"
            if len(raw) != n:
                problem = "truncated while being read (file changed)"
        if problem:
            _sniff(path, head)  # a known foreign format is refused by name
            raise CheckpointError(path, problem)
        f = _parse_header(path, raw, size)
        try:
            m = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as exc:
            raise CheckpointError(path, f"cannot map: {exc}") from exc
        if len(m) != size:
            m.close()
            raise CheckpointError(path, "file changed size while being opened")
        # ACCESS_COPY: a private mapping, writable from Python's side, so torch can wrap it
        # without a read-only warning; nothing is ever written back to the file.
        f.map = m
        return f
    except OSError as exc:
        raise CheckpointError(path, f"cannot read: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)


def _parse_header(path: Path, raw: bytes, size: int) -> _File:
    """Check a header (the JSON after the 8-byte length) against a file of ``size`` bytes."""
    if not raw.startswith(b"{"):
        raise CheckpointError(path, "corrupt header: does not start with '{'")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except _DuplicateKey as dup:
        raise CheckpointError(path, f"corrupt header: key {dup.args[0]!r} appears twice") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # ValueError covers JSONDecodeError and integers too long to convert.
        raise CheckpointError(path, f"corrupt header: {type(exc).__name__}: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError(path, "corrupt header: not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(path, "corrupt header: __metadata__ must map strings to strings")
    data_start = 8 + len(raw)
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
        raise CheckpointError(path, "corrupt header entry: not a JSON object", name)
    dtype_name = info.get("dtype")
    dtype = DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise CheckpointError(path, f"unsupported dtype {dtype_name!r}", name)
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
        raise CheckpointError(path, f"invalid shape {shape!r}", name)
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) and o >= 0 for o in offsets)
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


def _read_index(index: Path) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> shard file name) of a shard index, validated."""
    try:
        if index.stat().st_size > MAX_INDEX_BYTES:
            raise CheckpointError(index, f"corrupt shard index: larger than {MAX_INDEX_BYTES}")
        doc = json.loads(index.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise CheckpointError(index, f"cannot read shard index: {exc.strerror or exc}") from exc
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(index, f"corrupt shard index: {type(exc).__name__}: {exc}") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(index, "corrupt shard index: no weight_map object")
    for tensor, name in weight_map.items():
        if not isinstance(name, str):
            raise CheckpointError(index, f"shard name {name!r} is not a string", tensor)
    return weight_map


def _inside(where: Path, root: Path, name: str) -> Path:
    """``root / name`` resolved, refused unless it is a regular file inside ``root``."""
    if not name or "\x00" in name:
        raise CheckpointError(where, f"invalid shard name {name!r}")
    try:
        resolved = (root / name).resolve(strict=True)
    except FileNotFoundError:
        raise CheckpointError(where, f"shard {name!r} does not exist") from None
    except (OSError, RuntimeError, ValueError) as exc:  # symlink loops, bad names
        raise CheckpointError(where, f"cannot resolve shard {name!r}: {exc}") from None
    if resolved == root or not resolved.is_relative_to(root):
        raise CheckpointError(where, f"shard path {name!r} escapes {root}")
    if not resolved.is_file():
        raise CheckpointError(where, f"shard {name!r} is not a regular file")
    return resolved


def _resolve(checkpoint: str | os.PathLike) -> tuple[list[Path], dict[str, Path] | None]:
    """The files of a checkpoint and, for an indexed directory, tensor name -> its file."""
    path = Path(checkpoint)
    if path.is_file():
        return [path], None
    if not path.exists():
        raise CheckpointError(path, "no such checkpoint file or directory")
    if not path.is_dir():
        raise CheckpointError(path, "not a regular file or a directory")
    root = path.resolve()
    index = path / INDEX_NAME
    if index.is_file():
        weight_map = _read_index(index)
        by_name = {name: _inside(index, root, name) for name in sorted(set(weight_map.values()))}
        if not by_name:
            raise CheckpointError(index, "shard index lists no tensors")
        return list(by_name.values()), {t: by_name[n] for t, n in weight_map.items()}
    files = [_inside(path, root, p.name) for p in sorted(path.glob("*.safetensors"))]
    if not files:
        raise CheckpointError(path, "directory holds no .safetensors file")
    return files, None


def resolve_checkpoint_files(checkpoint: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint: one file, or a directory (index json honoured).

    Paths named by an index, and files found in a directory, must resolve (symlinks followed)
    to regular files inside the checkpoint's directory: ``../x``, absolute paths and symlinks
    that lead out are refused.
    """
    return _resolve(checkpoint)[0]


class CheckpointReader:
    """A validated, memory-mapped safetensors checkpoint (a file or a sharded directory).

    Opening parses and checks every header (and a shard index against the shards); it reads no
    tensor bytes. :meth:`tensors` yields zero-copy views in file order. Keep the reader alive
    while the views are in use.
    """

    def __init__(self, checkpoint: str | os.PathLike):
        self.path = Path(checkpoint)
        paths, indexed = _resolve(checkpoint)
        self.files: list[_File] = []
        try:
            for p in paths:
                self.files.append(_open_file(p))
            self._where: dict[str, _File] = {}
            for f in self.files:
                for name in f.entries:
                    if name in self._where:
                        raise CheckpointError(
                            f.path, f"also stored in {self._where[name].path.name}", name
                        )
                    self._where[name] = f
            if indexed is not None:
                self._check_index(indexed)
        except BaseException:
            self.close()
            raise

    def _check_index(self, indexed: dict[str, Path]) -> None:
        index = self.path / INDEX_NAME
        for name, file in indexed.items():
            holder = self._where.get(name)
            if holder is None or holder.path != file:
                raise CheckpointError(
                    file, "listed in the shard index for this file but not stored in it", name
                )
        for name, holder in self._where.items():
            if name not in indexed:
                raise CheckpointError(
                    holder.path, f"stored here but not listed in {index.name}", name
                )

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

    def file_of(self, name: str) -> Path | None:
        """The file that stores tensor ``name``, or None."""
        f = self._where.get(name)
        return f.path if f is not None else None

    def _map(self, f: _File) -> mmap.mmap:
        if f.map is None:
            raise CheckpointError(f.path, "reader is closed")
        return f.map

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
            got = _hash(memoryview(self._map(f))[f.data_start :])
            if got != want:
                raise CheckpointError(
                    f.path, "content hash mismatch: the file was changed or torn after it was saved"
                )

    def close(self) -> None:
        # Mappings close when the last view of them is gone (closing one that a tensor still
        # views would raise), so only the reader's references are dropped.
        for f in getattr(self, "files", []):
            f.map = None

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


def _write_all(f, data: memoryview | bytes) -> None:
    data = memoryview(data).cast("B")
    while data:
        n = f.write(data)
        if not n:  # a raw write that stores nothing and reports no error: treat as full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        data = data[n:]


def _remove_stale_temps(path: Path) -> None:
    """Delete temporary files of earlier saves into ``path``'s directory whose writer is gone.

    Only names :func:`save_checkpoint` makes are considered (``.<name>.<8 random>.tmp`` for
    this ``path`` or any ``*.safetensors``). A live writer holds an exclusive lock on its
    file; a killed one's lock went with it. The age test closes the window between a writer
    creating its file and locking it.
    """
    now = time.time()
    for tmp in path.parent.iterdir():
        m = _TEMP_NAME.match(tmp.name)
        if m is None or not (m["target"] == path.name or m["target"].endswith(".safetensors")):
            continue
        try:
            fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or now - st.st_mtime < STALE_TEMP_AGE_S:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        except OSError:
            continue  # locked: a writer is still at work
        finally:
            os.close(fd)


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
    swapped or torn file. Tensors must not share storage (write tied weights once). A failed
    write raises :class:`CheckpointWriteError` and leaves the file at ``path`` as it was.
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

    # The hash is computed while the data is written (one pass over the bytes) and then
    # written over a placeholder of the same length in the header.
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    meta[HASH_KEY] = "0" * 64
    header["__metadata__"] = meta
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # align the data section to 8 bytes
    marker = json.dumps({HASH_KEY: meta[HASH_KEY]}, separators=(",", ":"))[1:-1].encode()
    hash_at = 8 + raw.index(marker) + len(marker) - 65
    total = 8 + len(raw) + offset
    _remove_stale_temps(path)
    # mkstemp creates the file 0600 (owner-only) with O_EXCL, whatever the umask: no byte is
    # ever readable by others, and os.replace keeps the mode.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    written = 0
    try:
        with os.fdopen(fd, "wb", buffering=0) as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # marks the file as a live writer's
            _write_all(f, struct.pack("<Q", len(raw)) + raw)
            for t in cpu.values():
                if t.numel():
                    data = _bytes_of(t)
                    h.update(data)
                    _write_all(f, data)
            meta[HASH_KEY] = h.hexdigest()
            os.pwrite(f.fileno(), meta[HASH_KEY].encode(), hash_at)
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            written = os.stat(tmp).st_size
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise CheckpointWriteError(
                path,
                f"save failed after {written} of {total} bytes: {exc.strerror or exc}; "
                "the previous file at this path is untouched and the temporary file was removed",
                exc.errno,
            ) from exc
        raise
    if fsync:
        _fsync_dir(path.parent)
    return SavedCheckpoint(path, offset, meta[HASH_KEY], time.perf_counter() - started)


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (best effort: not every filesystem allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)
