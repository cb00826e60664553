"""How one tensor of a delta lands in live storage: scattered, or copied segment by segment.

Why a module of its own: the two ways a delta writes are the unit the transaction logs and
undoes. A *sparse* tensor's changed elements are mapped through the write map's segments to
the live elements they land on (:class:`Scatter`: positions and values); a *dense* one is
written segment by segment between two views, the segment's view of the delta's values and its
view of live storage (:class:`Copy`: no positions at all, so applying a dense tensor costs its
pre-images and bounded temporaries, not an int64 position per element). Each writes through a
function of its own (:func:`scatter`, :func:`copy`), which the fault-injection tests replace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..exact import bits_of
from .positions import Positions
from .undo import UndoLog
from .write_map import Held, Segment, WriteMap


@dataclass
class Scatter:
    """One segment's share of a sparse tensor: live elements ``where`` of ``storage`` get
    ``values``; ``where`` kept encoded and decoded a chunk at a time (:mod:`.positions`), and
    shared with the undo log."""

    storage: torch.Tensor
    where: Positions
    values: torch.Tensor

    def read(self) -> torch.Tensor:
        pre = torch.empty_like(self.values)
        for start, end, at in self.where.chunks(self.storage.device):
            torch.index_select(self.storage, 0, at, out=pre[start:end])
        return pre

    def write(self) -> None:
        for start, end, at in self.where.chunks(self.storage.device):
            scatter(self.storage, at, self.values[start:end])

    def landed(self) -> bool:
        return all(
            torch.equal(bits_of(self.storage[at]), bits_of(self.values[start:end]))
            for start, end, at in self.where.chunks(self.storage.device)
        )

    def log(self, undo: UndoLog, pre: torch.Tensor) -> None:
        undo.log(self.storage, self.where, pre)


@dataclass
class Copy:
    """One segment of a dense tensor: its view of live storage gets its view of the delta's
    values. No positions: the segment's geometry is the map, so a dense tensor costs its
    pre-images (the undo log) and nothing per element besides."""

    segment: Segment
    live: torch.Tensor
    values: torch.Tensor

    def read(self) -> torch.Tensor:
        return self.live.clone()

    def write(self) -> None:
        copy(self.live, self.values)

    def landed(self) -> bool:
        return torch.equal(bits_of(self.live), bits_of(self.values.to(self.live.device)))

    def log(self, undo: UndoLog, pre: torch.Tensor) -> None:
        undo.log(self.live, None, pre)


@dataclass
class Patch:
    """One tensor of the delta on this worker: its writes (scatters of a sparse tensor, each
    with which of the changed elements of ``indices`` it holds in ``held``; copies of a dense
    one, ``indices`` None); ``whole``: this worker holds all the tensor."""

    name: str
    shape: tuple[int, ...]
    indices: torch.Tensor | None
    values: torch.Tensor
    scatters: list[Scatter | Copy]
    held: list[Held]
    whole: bool


def scatter(storage: torch.Tensor, where: torch.Tensor, values: torch.Tensor) -> None:
    """One scattered write of a chunk (a function of its own: the fault-injection tests
    replace it)."""
    storage[where] = values


def copy(live: torch.Tensor, values: torch.Tensor) -> None:
    """One dense segment's write (a function of its own, as :func:`scatter`)."""
    live.copy_(values)


def write_patch(patch: Patch) -> None:
    for part in patch.scatters:
        part.write()


def cost(patch: Patch) -> int:
    return patch.values.numel()


def patch_of(
    name: str,
    shape: tuple[int, ...],
    indices: torch.Tensor | None,
    values: torch.Tensor,
    write_map: WriteMap,
) -> Patch:
    """Map ``indices`` (None: every element, a dense tensor: a copy per segment, between
    views) of checkpoint tensor ``name`` onto the live elements of this worker."""
    numel = math.prod(shape)
    if indices is None:
        copies: list[Scatter | Copy] = [
            Copy(
                seg,
                seg.live(),
                values.as_strided(
                    seg.shape, seg.src_stride, values.storage_offset() + seg.src_offset
                ),
            )
            for seg in write_map.segments[name]
        ]
        return Patch(name, shape, None, values, copies, [], write_map.whole(name, numel))
    scatters: list[Scatter | Copy] = []
    helds: list[Held] = []
    for seg in write_map.segments[name]:
        held, where = seg.positions(indices)
        if not where.numel:
            continue
        device = seg.storage.device
        scatters.append(Scatter(seg.storage, where, held.take(values).to(device)))
        helds.append(held)
    return Patch(name, shape, indices, values, scatters, helds, write_map.whole(name, numel))
