"""Writing checkpoints: streamed, atomic, hashed, owner-only.

One write path, :class:`CheckpointWriter`: the header (names, shapes, dtypes, byte offsets) is
computed from metadata before any tensor exists, so a sharded trainer can gather one tensor at a
time, hand it over, and free it; the writer never holds more than the tensor it is writing.
Tensors arrive in header order; each is checked against its entry (name, shape, dtype), and its
bytes make one pass through the writer: chunk by chunk (:data:`CHUNK_BYTES`, so a chunk is
still in cache for the next step) each is cast to the header's dtype if asked (``cast=True``),
copied off its device (through a pinned host buffer for an accelerator's tensor), folded into
the blake3 hash of the data section and written at its offset. :meth:`~CheckpointWriter.finish`
writes the hash into the header, fsyncs (``fsync=True``: a checkpoint meant to survive a power
loss; a transport file in RAM is not fsynced) and renames. :func:`save_checkpoint` is the same
writer fed from a mapping.

``hashed=False`` leaves the hash out (a transport file nobody will check: one pass less);
``reuse``: a spare file overwritten in place (:func:`~.space.open_temp`).
``maps`` (:class:`~.mapping.TransportMaps`, the RAM transport's) writes the data through a shared
map of the file kept from the last time this file was written: a CPU tensor is then one
multi-threaded ``copy_`` (with its cast) into the file's pages, not a ``write()`` per chunk.

Writes go to an owner-only (0600) temporary file in the target directory, locked while it is
written, its whole size reserved up front (so a full filesystem refuses the checkpoint before
the first tensor is gathered, not half-way), and are renamed into place, so a reader never sees
a partial file, a file an engine has mapped is never overwritten in place, and a write that
fails (disk full, file too large, a refused tensor, an abort) leaves the previous file untouched
and removes its temporary file. The temporary file of a writer that was killed (SIGKILL) is left
behind, hidden, under a name no reader picks up; a later save into the same directory removes it
once its lock is free and it is a minute old.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..layout import storage_start
from .errors import CheckpointError, CheckpointWriteError
from .format import DTYPE_NAMES
from .header_plan import TensorMeta, plan_header
from .mapping import TransportMaps
from .space import fsync_dir, open_temp, reserve

# One pass per tensor: a chunk is cast, hashed and written while in cache (L3); 4 MiB, not less,
# since each cast is a torch op, and a loaded machine makes every op wait for all its threads.
CHUNK_BYTES = 4 << 20


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


@dataclass(frozen=True)
class SavedCheckpoint:
    """A checkpoint written by :class:`CheckpointWriter` or :func:`save_checkpoint`."""

    path: Path
    bytes: int
    hash: str
    elapsed_s: float


class CheckpointWriter:
    """One safetensors file streamed to ``path``: header first, then tensors in header order.

    ``specs`` (name -> anything with ``shape`` and ``dtype``, or such pairs) fixes the header
    before any tensor exists; constructing the writer creates the temporary file and writes the
    header. Then :meth:`write` each tensor in that order, and :meth:`finish`. A tensor out of
    order, unknown, of another shape or dtype, a write error, :meth:`abort`, or leaving a
    ``with`` block without :meth:`finish` aborts: the temporary file is removed and the file at
    ``path`` stays as it was. The writer keeps no reference to a tensor once :meth:`write`
    returns, so the caller's peak memory is one tensor (plus a contiguous copy of a
    non-contiguous one).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        specs: Mapping[str, TensorMeta] | Iterable[tuple[str, TensorMeta]],
        metadata: Mapping[str, str] | None = None,
        fsync: bool = True,
        hashed: bool = True,
        reuse: str | os.PathLike | None = None,
        maps: TransportMaps | None = None,
    ) -> None:
        self._started = time.perf_counter()
        self._bounce: torch.Tensor | None = None  # the chunk buffer of cast or device tensors
        self._mapped: torch.Tensor | None = None  # the file's bytes, when written through a map
        self._pos = 0  # where the next data byte goes
        self.path = Path(path)
        self.fsync = fsync
        pairs = specs.items() if isinstance(specs, Mapping) else specs
        self._planned, head, self._hash_at = plan_header(self.path, pairs, metadata, hashed)
        self._order = list(self._planned)
        self._next = 0
        self.nbytes = max((p.end for p in self._planned.values()), default=0)
        self._total = len(head) + self.nbytes
        self._hash = _hasher() if hashed else None
        self._state = "open"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self._tmp = open_temp(self.path, reuse)
        self._file = os.fdopen(fd, "wb", buffering=0)
        self._guard(lambda: self._open(head, maps))

    @property
    def names(self) -> list[str]:
        """The tensors of the header, in the order :meth:`write` takes them."""
        return list(self._order)

    @property
    def pending(self) -> list[str]:
        """The tensors still to be written, in order."""
        return self._order[self._next :]

    def _open(self, head: bytes, maps: TransportMaps | None) -> None:
        fd = self._file.fileno()
        fcntl.flock(fd, fcntl.LOCK_EX)  # marks the file as a live writer's
        _write_all(self._file, head)
        self._pos = len(head)
        reserved = reserve(fd, len(head), self.nbytes)
        if maps is not None and reserved and self.nbytes:
            # Every page is allocated (reserved), so no write through the map can meet a full
            # filesystem; the map extends the (still temporary) file to its length if shorter.
            with contextlib.suppress(OSError, ValueError):  # no map (no /proc, no memory): write
                self._mapped = maps.view(fd, self._total)

    def write(self, name: str, tensor: torch.Tensor, cast: bool = False) -> None:
        """Write the next tensor of the header; anything else aborts and raises by name.

        ``cast=True``: a tensor of another dtype is converted to the header's as it is copied
        (chunk by chunk, no full-size copy); its shape must still match. The tensor may live on
        any device."""
        self._check_open()
        expected = self._order[self._next] if self._next < len(self._order) else None
        if name != expected:
            if name not in self._planned:
                problem = "not in the header"
            elif self._order.index(name) < self._next:
                problem = "written twice"
            else:
                problem = f"out of order: {expected!r} comes first"
            self._refuse(problem, name)
        p = self._planned[name]
        if (tensor.dtype != p.dtype and not cast) or tuple(tensor.shape) != p.shape:
            got = f"{tuple(tensor.shape)} {tensor.dtype}"
            self._refuse(f"{got} does not match the header's {p.shape} {p.dtype}", name)
        self._guard(lambda: self._write_tensor(tensor, p.dtype))
        self._next += 1

    def _write_tensor(self, tensor: torch.Tensor, dtype: torch.dtype) -> None:
        """One pass: each chunk cast/copied (if needed), hashed and written while in cache."""
        t = tensor.detach()
        if not t.numel():
            return
        flat = t.reshape(-1)  # a view when contiguous (a copy of one tensor otherwise)
        if self._mapped is not None and t.device.type == "cpu" and self._pos % dtype.itemsize == 0:
            self._copy_into_map(flat, dtype)  # (an unaligned offset is copied as bytes, below)
            return
        if t.device.type == "cpu" and t.dtype == dtype:
            data = _bytes_of(t)  # a view of a contiguous tensor: no copy at all
            for i in range(0, len(data), CHUNK_BYTES):
                self._put(data[i : i + CHUNK_BYTES])
            return
        bounce = self._chunk_buffer(t.device).view(dtype)
        per = bounce.numel()
        for i in range(0, flat.numel(), per):
            part = flat[i : i + per]
            buf = bounce[: part.numel()]
            buf.copy_(part.to(dtype) if part.device.type != "cpu" else part)  # cast on device
            self._put(_bytes_of(buf))

    def _copy_into_map(self, flat: torch.Tensor, dtype: torch.dtype) -> None:
        """A CPU tensor copied (and cast) straight into the mapped file: one ``copy_`` over
        the whole tensor (torch splits it across threads), or, when hashing, chunk by chunk,
        each hashed from the file's pages while it is in cache."""
        assert self._mapped is not None
        n = flat.numel() * dtype.itemsize
        dst = self._mapped[self._pos : self._pos + n].view(dtype)
        if self._hash is None:
            dst.copy_(flat)
        else:
            per = CHUNK_BYTES // dtype.itemsize
            for i in range(0, flat.numel(), per):
                chunk = dst[i : i + per]
                chunk.copy_(flat[i : i + per])
                self._hash.update(_bytes_of(chunk))
        self._pos += n

    def _put(self, data: memoryview) -> None:
        """Hash ``data`` and store it at the next position (through the map, or written)."""
        if self._hash is not None:
            self._hash.update(data)
        if self._mapped is not None:
            self._mapped[self._pos : self._pos + len(data)].copy_(
                torch.frombuffer(data, dtype=torch.uint8)
            )
        else:
            _write_all(self._file, data)
        self._pos += len(data)

    def _chunk_buffer(self, device: torch.device) -> torch.Tensor:
        """:data:`CHUNK_BYTES` of host memory, pinned when tensors come from an accelerator
        (a device-to-host copy into pinned memory runs at the link's speed, and needs no
        staging copy by the driver)."""
        pinned = device.type != "cpu"
        if self._bounce is None or (pinned and not self._bounce.is_pinned()):
            self._bounce = None
            if pinned:
                with contextlib.suppress(RuntimeError):  # no pinning backend: plain memory
                    self._bounce = torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)
            if self._bounce is None:
                self._bounce = torch.empty(CHUNK_BYTES, dtype=torch.uint8)
        return self._bounce

    def finish(self) -> SavedCheckpoint:
        """Check every tensor was written, write the hash, fsync, rename into place."""
        self._check_open()
        if self._next < len(self._order):
            missing = self._order[self._next :]
            self._refuse(f"never written ({len(missing)} tensors missing)", missing[0])
        digest = self._hash.hexdigest() if self._hash is not None else ""
        self._guard(lambda: self._commit(digest))
        self._state = "finished"
        self._bounce = self._mapped = None
        if self.fsync:
            fsync_dir(self.path.parent)
        return SavedCheckpoint(self.path, self.nbytes, digest, time.perf_counter() - self._started)

    def _commit(self, digest: str) -> None:
        if self._hash_at is not None:
            os.pwrite(self._file.fileno(), digest.encode(), self._hash_at)
        if os.fstat(self._file.fileno()).st_size != self._total:  # recycled or mapped: longer
            os.ftruncate(self._file.fileno(), self._total)
        if self.fsync:
            os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        """Remove the temporary file; the file at ``path`` stays as it was. Idempotent."""
        if self._state != "open":
            return
        self._state = "aborted"
        self._bounce = self._mapped = None
        with contextlib.suppress(OSError):
            self._file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._tmp)

    def _check_open(self) -> None:
        if self._state != "open":
            raise CheckpointError(self.path, f"the writer is {self._state}; start a new one")

    def _refuse(self, problem: str, name: str) -> None:
        self.abort()
        raise CheckpointError(self.path, problem + "; nothing was written", name)

    def _guard(self, step) -> None:
        """Run one I/O step; on any failure abort, and report an OSError as a write error."""
        try:
            step()
        except BaseException as exc:
            written = self._pos
            self.abort()
            if isinstance(exc, OSError):
                raise CheckpointWriteError(
                    self.path,
                    f"save failed after {written} of {self._total} bytes: "
                    f"{exc.strerror or exc}; the previous file at this path is untouched and "
                    "the temporary file was removed",
                    exc.errno,
                ) from exc
            raise

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self._state != "open":
            return
        self.abort()
        if exc_type is None:
            raise CheckpointError(
                self.path, "the writer was left without finish(); nothing was written"
            )


def _hasher():
    import blake3

    return blake3.blake3(max_threads=blake3.blake3.AUTO)


def save_checkpoint(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    metadata: Mapping[str, str] | None = None,
    fsync: bool = True,
) -> SavedCheckpoint:
    """Write ``tensors`` as one safetensors file at ``path``, atomically, owner-only;
    ``fsync=False`` for a file that need not survive a power loss (a transport file in RAM).

    The header carries ``metadata`` plus a blake3 hash of the data section, so a push can tell a
    swapped or torn file. Tensors must not share storage (write tied weights once). A failed
    write raises :class:`CheckpointWriteError` and leaves the file at ``path`` as it was. The
    same writer as :class:`CheckpointWriter`, fed from a mapping already in memory.
    """
    path = Path(path)
    owners: dict[tuple[str, int, int], str] = {}
    cpu: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if t.dtype not in DTYPE_NAMES:
            raise CheckpointError(path, f"dtype {t.dtype} has no safetensors name", name)
        t = t.detach()  # any device: the writer copies it off chunk by chunk
        if t.numel():
            key = storage_start(t)
            if key in owners:
                raise CheckpointError(
                    path, f"shares storage with {owners[key]!r}; write it once", name
                )
            owners[key] = name
        cpu[name] = t
    with CheckpointWriter(path, cpu, metadata, fsync) as writer:
        for name, t in cpu.items():
            writer.write(name, t)
        return writer.finish()
