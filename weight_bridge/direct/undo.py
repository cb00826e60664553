"""The undo log of a delta: the pre-images of every element it wrote.

Why: a delta is applied in place, element by element; reading what each element held before
the first write makes undoing it O(delta) and exact, with no file to re-read (a failed delta,
or a committed one another rank's failure rolls back). It is held until the next update, so it
is kept as small as the delta that made it: a scattered write's positions in the delta file's
own encoding (2 bytes each, sorted, in blocks of 65536), a dense tensor's none at all (a view of
live storage, by the segment's geometry), so a log holds about the bytes of the delta it undoes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..checkpoint.delta import decode_indices, encode_sparse
from .derived import refresh_derived_state
from .state import bridge_state

__all__ = ["UndoLog"]


@dataclass(frozen=True)
class _Positions:
    """Sorted storage positions, as the delta file stores indices: ``first`` plus, per block
    of 65536 after it, a count (int32) and each position's low 16 bits (int16)."""

    first: int
    blocks: torch.Tensor
    offsets: torch.Tensor

    @classmethod
    def of(cls, where: torch.Tensor) -> _Positions | torch.Tensor:
        """``where`` encoded when it is sorted (a linear segment's positions are), else as it
        is, in 4 bytes where it fits."""
        if where.numel() > 1 and bool((where[1:] > where[:-1]).all()):
            first = int(where[0])
            span = int(where[-1]) - first + 1
            parts = encode_sparse((where - first).cpu(), where[:0], span)
            return cls(first, parts["blocks"], parts["offsets"])
        small = not where.numel() or int(where.max()) < 2**31
        return where.to(torch.int32) if small else where

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes + self.offsets.nbytes

    def decode(self, device: torch.device) -> torch.Tensor:
        return decode_indices(self.blocks, self.offsets).add_(self.first).to(device)


@dataclass
class UndoLog:
    """The pre-images of every element a delta wrote, in write order: restoring them in
    reverse gives back the previous bits exactly, with no file. Each entry is a storage, the
    positions written (None: the storage is a view written whole) and their pre-images.
    ``modules``: whose derived state to refresh afterwards; ``fingerprints``: the served
    fingerprints before."""

    entries: list[tuple[torch.Tensor, _Positions | torch.Tensor | None, torch.Tensor]] = field(
        default_factory=list
    )
    modules: dict[str, str] = field(default_factory=dict)
    fingerprints: dict[str, int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """What the log holds: positions and pre-images."""
        return sum((w.nbytes if w is not None else 0) + p.nbytes for _, w, p in self.entries)

    def log(self, storage: torch.Tensor, where: torch.Tensor | None, pre: torch.Tensor) -> None:
        """Log the pre-images ``pre`` of ``storage[where]`` (``where`` None: of all of the view
        ``storage``)."""
        self.entries.append((storage, _Positions.of(where) if where is not None else None, pre))

    def undo(self, model: torch.nn.Module) -> None:
        """Restore every pre-image (newest first), re-derive, and put the fingerprints back."""
        for storage, where, pre in reversed(self.entries):
            if where is None:
                storage.copy_(pre)
            elif isinstance(where, _Positions):
                storage[where.decode(storage.device)] = pre
            else:
                storage[where] = pre
        state = bridge_state(model)
        refresh_derived_state(model, self.modules)
        state.fingerprints.update(self.fingerprints)
