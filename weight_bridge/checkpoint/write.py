"""Writing checkpoints: atomic, hashed, owner-only.

Writes go to an owner-only (0600) temporary file in the target directory, locked while it is
written, and are renamed into place, so a reader never sees a partial file, a file an engine
has mapped is never overwritten in place, and a write that fails (disk full, file too large)
leaves the previous file untouched and removes its temporary file. The temporary file of a
writer that was killed (SIGKILL) is left behind, hidden, under a name no reader picks up; a
later save into the same directory removes it once its lock is free and it is a minute old.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import stat
import struct
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import CheckpointError, CheckpointWriteError
from .format import DTYPE_NAMES, HASH_KEY

__all__ = ["STALE_TEMP_AGE_S", "SavedCheckpoint", "save_checkpoint"]

STALE_TEMP_AGE_S = 60.0  # an unlocked temporary file this old belongs to a dead writer
_TEMP_NAME = re.compile(r"^\.(?P<target>.+)\.[a-z0-9_]{8}\.tmp$")  # mkstemp's 8 characters


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
