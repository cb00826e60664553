"""One sharded (DTensor) parameter gathered, in full, onto the ranks that write.

``DTensor.full_tensor()`` gathers onto every rank, and on gloo through a list of shards that is
then concatenated: two full copies at its peak. For the layout FSDP2 gives on a
one-dimensional mesh over all ranks (``Shard(0)``, rows split as :func:`torch.chunk` splits
them), the writers instead receive each rank's rows straight into their place in one
preallocated tensor (point-to-point, no staging copy), and the other ranks only send: one full
copy, on the writers only. Any other layout (tensor parallelism, a 2-D
mesh, ``Shard(1)``, ``Partial``) falls back to ``full_tensor()``.

A gather is taken in two parts so that a local failure cannot strand the other ranks in a
collective: :meth:`ShardGather.prepare` does everything that can fail on one rank alone (shapes
checked, buffers allocated) and :meth:`ShardGather.run` only communicates, after the ranks have
agreed that every one of them is ready.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def is_dtensor(t: object) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _rows(n: int, parts: int) -> list[tuple[int, int]]:
    """(offset, length) of each part of ``n`` rows as :func:`torch.chunk` (and DTensor) split."""
    size = -(-n // parts)
    starts = [min(n, r * size) for r in range(parts + 1)]
    return [(starts[r], starts[r + 1] - starts[r]) for r in range(parts)]


class ShardGather:
    """The full tensor of one DTensor, for the writers (``None`` on the other ranks)."""

    def __init__(self, t: Any, writers: Sequence[int]) -> None:
        self.t = t
        self.writers = list(writers)
        self.rank = torch.distributed.get_rank()
        self.out: torch.Tensor | None = None
        self.local: torch.Tensor | None = None
        self.ranks: list[int] = []
        self.rows: list[tuple[int, int]] = []
        self.direct = self._direct_layout()

    def _direct_layout(self) -> bool:
        from torch.distributed.tensor import Replicate, Shard

        mesh, placements = self.t.device_mesh, self.t.placements
        world = torch.distributed.get_world_size()
        if mesh.ndim != 1 or mesh.size() != world or len(self.t.shape) == 0:
            return False
        self.ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
        if isinstance(placements[0], Replicate):
            return True
        return isinstance(placements[0], Shard) and placements[0].dim == 0

    def prepare(self) -> ShardGather:
        """Local work only: this rank's rows checked and made contiguous, the writer's buffer."""
        from torch.distributed.tensor import Replicate

        if not self.direct:
            return self
        local = self.t.to_local()
        if isinstance(self.t.placements[0], Replicate):
            self.local = local
            return self
        self.rows = _rows(self.t.shape[0], len(self.ranks))
        _, mine = self.rows[self.ranks.index(self.rank)]
        if local.shape[0] != mine or tuple(local.shape[1:]) != tuple(self.t.shape[1:]):
            raise RuntimeError(
                f"rank {self.rank} holds a shard of shape {tuple(local.shape)} where the chunk "
                f"layout of {tuple(self.t.shape)} over {len(self.ranks)} ranks puts {mine} rows"
            )
        self.local = local.contiguous()
        if self.rank in self.writers:
            self.out = torch.empty(self.t.shape, dtype=self.t.dtype, device=local.device)
        return self

    def run(self) -> torch.Tensor | None:
        """The communication (every rank, after the ranks agreed they are all prepared)."""
        from torch.distributed.tensor import Replicate

        writer = self.rank in self.writers
        if not self.direct:
            full = self.t.full_tensor()
            return full if writer else None
        if isinstance(self.t.placements[0], Replicate):
            return self.local if writer else None
        assert self.local is not None
        pending: list[Any] = []
        for src, (offset, length) in zip(self.ranks, self.rows, strict=True):
            if not length:
                continue
            if src == self.rank:
                if writer:
                    assert self.out is not None
                    self.out.narrow(0, offset, length).copy_(self.local)
                others = [w for w in self.writers if w != self.rank]
                pending.extend(torch.distributed.isend(self.local, w) for w in others)
            elif writer:
                assert self.out is not None
                pending.append(torch.distributed.irecv(self.out.narrow(0, offset, length), src))
        for work in pending:
            work.wait()
        out, self.out, self.local = self.out, None, None
        return out
