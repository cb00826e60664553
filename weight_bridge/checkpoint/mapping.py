"""Writable memory maps of transport files, kept by the writer from one sync to the next.

Why: writing a checkpoint into tmpfs with ``write()`` copies it on one thread, and writing it
through a *new* shared mapping pays a page fault per page on first touch (``docs/sync.md``). A
transport file is recycled (:func:`~weight_bridge.checkpoint.space.open_temp`): the same inode,
so the same pages, is written again two syncs later, and its kept mapping still holds every page,
so the write is one multi-threaded ``copy_`` at the speed of a memory copy.

A map is kept per file (device, inode) while the file exists: a deleted file's map is dropped at
the next :meth:`~TransportMaps.view` or :meth:`~TransportMaps.drop_unlinked` (the trainer calls it
right after pruning), so a kept map never holds RAM that no file shows. A map is only made for a
file whose whole size was reserved (``fallocate``): a write through a mapping cannot report a
full filesystem except by killing the process (SIGBUS).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass

import torch

_SLACK = 2 << 20  # maps are this much rounded up: a header a few bytes longer next sync still fits


@dataclass
class _Kept:
    fd: int  # our own descriptor of the file: its link count tells whether it still exists
    map: mmap.mmap
    bytes: torch.Tensor  # the whole map, as uint8


class TransportMaps:
    """Shared, writable maps of the files a writer fills, kept by file while the file exists."""

    def __init__(self) -> None:
        self._kept: dict[tuple[int, int], _Kept] = {}

    def view(self, fd: int, size: int) -> torch.Tensor:
        """The first ``size`` bytes of the file open at ``fd`` (read-write, its first ``size``
        bytes reserved) as a uint8 tensor over a shared map: the one kept for this file if it
        is long enough, else a new one, kept from now on. A new map is a little longer than
        ``size`` (so the next, slightly longer header still fits); a file shorter than its map
        is extended to it (a hole beyond ``size``, never touched), and the caller cuts the file
        to its size once written."""
        self.drop_unlinked()
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        kept = self._kept.get(key)
        if kept is not None and len(kept.map) < size:
            self._drop(key)
            kept = None
        length = len(kept.map) if kept is not None else -(-size // _SLACK) * _SLACK
        if st.st_size < length:
            os.ftruncate(fd, length)
        if kept is None:
            # The map's own open file (mmap keeps a dup of the descriptor it is given): one of
            # the writer's would share, and so outlive, the writer's lock.
            own = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
            try:
                m = mmap.mmap(own, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except BaseException:
                os.close(own)
                raise
            kept = _Kept(own, m, torch.frombuffer(m, dtype=torch.uint8))
            self._kept[key] = kept
        return kept.bytes[:size]

    def drop_unlinked(self) -> None:
        """Unmap the files that were deleted (their pages go back to the filesystem)."""
        for key, kept in list(self._kept.items()):
            if os.fstat(kept.fd).st_nlink == 0:
                self._drop(key)

    def close(self) -> None:
        """Unmap every file."""
        for key in list(self._kept):
            self._drop(key)

    def __len__(self) -> int:
        return len(self._kept)

    def _drop(self, key: tuple[int, int]) -> None:
        kept = self._kept.pop(key)
        os.close(kept.fd)
        del kept.bytes
        # A view still alive (a writer that has not finished) keeps the map until it goes.
        with contextlib.suppress(BufferError):
            kept.map.close()
