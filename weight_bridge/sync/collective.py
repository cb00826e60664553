"""The ranks' steps of a sync, each taken the same way: try locally, agree, go on or all fail.

Every rank makes every collective call whatever happened locally, and the ranks agree on
success before going on (``reduce_boolean_decision``, which is also the barrier), so one rank's
failure makes every rank fail at the same point instead of leaving the others waiting in a
collective that never completes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class StepFailed(Exception):
    """A step failed on at least one rank; every rank raises it at the same point.

    ``error`` is this rank's own exception, or None when only another rank failed. A signal
    between the ranks' steps, not an error of the library: the callback catches it and raises
    this rank's own error (or warns), so no caller ever sees it.
    """

    def __init__(self, what: str, error: BaseException | None) -> None:
        super().__init__(f"{what} failed" + (f": {error}" if error is not None else " elsewhere"))
        self.what = what
        self.error = error


class Collective:
    """One helper for "try locally, agree across ranks, fail everywhere" over a strategy.

    Works for any Lightning strategy: on a single device the agreement is the local outcome.
    """

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def run(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` on this rank, then agree; raises :class:`StepFailed` on every rank unless
        every rank succeeded. A :class:`StepFailed` from inside ``fn`` (an agreement already
        reached by all ranks) passes through without another round."""
        error: BaseException | None = None
        result: Any = None
        try:
            result = fn()
        except StepFailed:
            raise
        except Exception as exc:
            error = exc
        self.agree(what, error)
        return result

    def agree(self, what: str, error: BaseException | None) -> None:
        """All ranks: go on if no rank has an error, else raise :class:`StepFailed`."""
        if not self.strategy.reduce_boolean_decision(error is None, all=True):
            raise StepFailed(what, error)

    def same(self, what: str, value: str) -> None:
        """All ranks hold the same ``value`` (rank zero's), or every rank fails."""
        reference = self.strategy.broadcast(value, src=0)
        problem = None
        if reference != value:
            problem = RuntimeError(f"this rank's {what} differs from rank 0's")
        self.agree(what, problem)
