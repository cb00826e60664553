"""Live positions a delta writes, held as small as the delta file holds its indices.

Why: a sparse tensor's changed elements land on live positions that a delta's scatters, its
read-back and its undo log all need, from preparation until the next update. As int64 that is
8 bytes per changed element, twice what the file carries for it and more than the undo log's
bound; so sorted positions are kept in the file's own encoding (:mod:`weight_bridge.delta.format`:
2 bytes each, counted in blocks of 65536) and are only ever decoded a chunk at a time
(:data:`CHUNK`), built a chunk at a time too. Unsorted ones (a segment solved coordinate by
coordinate) stay a plain tensor, in 4 bytes where they fit.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from ..delta.format import BLOCK, decode_indices

CHUNK = 1 << 18  # positions handled at a time: int64 temporaries of 2 MiB


@dataclass(frozen=True)
class Positions:
    """Flat positions in one storage: ``first`` plus, per block of 65536 after it, a count
    (``blocks``, int32) and each position's low 16 bits (``offsets``, int16), sorted; or
    ``plain`` (any order)."""

    first: int = 0
    blocks: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    plain: torch.Tensor | None = None

    @classmethod
    def of(cls, where: torch.Tensor) -> Positions:
        """``where`` encoded when it is strictly increasing, else kept plain (4 bytes where
        every position fits)."""
        where = where.reshape(-1)
        if where.numel() > 1 and bool((where[1:] > where[:-1]).all()):
            first, last = int(where[0]), int(where[-1])
            chunks = (where[s : s + CHUNK] for s in range(0, where.numel(), CHUNK))
            return cls.sorted_chunks(chunks, where.numel(), first, last)
        small = not where.numel() or int(where.max()) < 2**31
        return cls(plain=where.to(torch.int32) if small else where)

    @classmethod
    def sorted_chunks(
        cls, chunks: Iterable[torch.Tensor], count: int, first: int, last: int
    ) -> Positions:
        """Encode ``count`` strictly increasing positions from ``first`` to ``last``, given a
        chunk at a time (no int64 copy of them all)."""
        blocks = torch.zeros((last - first) // BLOCK + 1, dtype=torch.int64)
        offsets = torch.empty(count, dtype=torch.int16)
        done = 0
        for chunk in chunks:
            rel = chunk.to(device="cpu", dtype=torch.int64) - first
            blocks += torch.bincount(rel >> 16, minlength=blocks.numel())
            low = offsets[done : done + rel.numel()]
            low.copy_(rel.bitwise_and_(BLOCK - 1).to(torch.int32))  # int16: a bit pattern
            done += rel.numel()
        assert done == count, (done, count)
        return cls(first, blocks.to(torch.int32), offsets)

    @property
    def numel(self) -> int:
        if self.plain is not None:
            return self.plain.numel()
        assert self.offsets is not None
        return self.offsets.numel()

    @property
    def nbytes(self) -> int:
        if self.plain is not None:
            return self.plain.nbytes
        assert self.blocks is not None and self.offsets is not None
        return self.blocks.nbytes + self.offsets.nbytes

    def chunks(self, device: torch.device) -> Iterator[tuple[int, int, torch.Tensor]]:
        """``(start, end, positions)``: positions ``start:end`` as int64 on ``device``, at most
        :data:`CHUNK` at a time, in order."""
        n = self.numel
        if self.plain is not None:
            for s in range(0, n, CHUNK):
                yield s, min(s + CHUNK, n), self.plain[s : s + CHUNK].to(device, torch.int64)
            return
        assert self.blocks is not None and self.offsets is not None
        counts = self.blocks.to(torch.int64)
        ends = counts.cumsum(0)  # one past each block's last position
        starts = ends - counts
        for s in range(0, n, CHUNK):
            e = min(s + CHUNK, n)
            b0 = int(torch.searchsorted(ends, s, right=True))
            b1 = int(torch.searchsorted(ends, e - 1, right=True))
            held = ends[b0 : b1 + 1].clamp(max=e) - starts[b0 : b1 + 1].clamp(min=s)
            where = decode_indices(held.to(torch.int32), self.offsets[s:e])  # from block b0
            yield s, e, where.add_(b0 * BLOCK + self.first).to(device)
