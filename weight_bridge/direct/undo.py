"""The undo log of a delta: the pre-images of every element it wrote.

Why: a delta is applied in place, element by element; reading what each element held before
the first write makes undoing it O(delta) and exact, with no file to re-read (a failed delta,
or a committed one another rank's failure rolls back).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .derived import refresh_derived_state
from .state import bridge_state

__all__ = ["UndoLog"]


@dataclass
class UndoLog:
    """The pre-images of every element a delta wrote, in write order: restoring them in
    reverse gives back the previous bits exactly, with no file. ``modules``: whose derived
    state to refresh afterwards; ``fingerprints``: the served fingerprints before."""

    entries: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    modules: dict[str, str] = field(default_factory=dict)
    fingerprints: dict[str, int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """What the log holds: positions and pre-images."""
        return sum(w.nbytes + p.nbytes for _, w, p in self.entries)

    def log(self, storage: torch.Tensor, where: torch.Tensor, pre: torch.Tensor) -> None:
        """Log the pre-images ``pre`` of ``storage[where]``, positions in 4 bytes where the
        storage has fewer than 2**31 elements (an int32 index indexes as an int64 one)."""
        if where.dtype == torch.int64 and storage.numel() < 2**31:
            where = where.to(torch.int32)
        self.entries.append((storage, where, pre))

    def undo(self, model: torch.nn.Module) -> None:
        """Restore every pre-image (newest first), re-derive, and put the fingerprints back."""
        for storage, where, pre in reversed(self.entries):
            storage[where] = pre
        state = bridge_state(model)
        refresh_derived_state(model, self.modules)
        state.fingerprints.update(self.fingerprints)
