"""When a sync happens, and whether it may be partial.

:class:`Schedule` is the configuration (a frozen dataclass, so LightningCLI fills it from a
nested YAML mapping); :class:`SyncClock` is its state over one run. Neither knows about files,
ranks or engines: the callback asks the clock whether a step is due and whether the next sync
may leave out what cannot change, and tells it how each sync ended.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Schedule", "SyncClock"]


@dataclass(frozen=True)
class Schedule:
    """When to sync, and when a sync must be complete.

    Cadence counts optimizer steps (``trainer.global_step``), so gradient accumulation does not
    change it: a sync happens when the step advanced to one that is due (``every_n_train_steps``
    and/or ``at_steps``), before the first step (``push_on_train_start``; version = the current
    step), and at the end (``push_on_train_end``). No step is pushed twice in one run. A run
    resumed from a checkpoint (or starting past step 0) always syncs on train start, since the
    engine would otherwise serve the weights it was started with.

    ``skip_frozen``: after a complete sync, later ones carry only what training can change (a
    *partial* checkpoint, see :mod:`callbacks.changed`). The first sync of a run, the first
    after a failed one, and every ``full_every_k``-th (if set) are complete.
    """

    every_n_train_steps: int | None = 1
    at_steps: tuple[int, ...] = ()
    push_on_train_start: bool = True
    push_on_train_end: bool = True
    skip_frozen: bool = True
    full_every_k: int | None = None

    def __post_init__(self) -> None:
        n = self.every_n_train_steps
        if n is not None and n < 1:
            raise ValueError(f"every_n_train_steps must be >= 1 or None, not {n}")
        steps = tuple(sorted(set(self.at_steps or ())))
        if any(s < 0 for s in steps):
            raise ValueError(f"at_steps must be non-negative, not {list(self.at_steps)}")
        object.__setattr__(self, "at_steps", steps)  # normalised: sorted, unique, a tuple
        if self.full_every_k is not None and self.full_every_k < 1:
            raise ValueError(f"full_every_k must be >= 1 or None, not {self.full_every_k}")

    def due(self, step: int) -> bool:
        """Whether ``step`` is a step the cadence asks for."""
        n = self.every_n_train_steps
        return (n is not None and step % n == 0) or step in self.at_steps


class SyncClock:
    """A :class:`Schedule` over one run: which steps to sync, which syncs may be partial.

    ``last_pushed_step`` is the step of the last successful sync (restored on resume);
    ``partials_in_row`` is None while the next sync must be complete.
    """

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.last_pushed_step: int | None = None
        self.partials_in_row: int | None = None
        self._seen_step: int | None = None

    def at_train_start(self, step: int, resumed: bool) -> bool:
        """A new run: the next sync is complete. Sync now when asked to, or when resumed."""
        self._seen_step = step
        self.partials_in_row = None
        s = self.schedule
        return s.push_on_train_start or resumed or step in s.at_steps

    def at_batch_end(self, step: int) -> bool:
        """Sync when the optimizer step advanced to a due step not yet pushed."""
        advanced = step != self._seen_step
        self._seen_step = step
        return advanced and self.schedule.due(step) and step != self.last_pushed_step

    def at_train_end(self, step: int) -> bool:
        return self.schedule.push_on_train_end and step != self.last_pushed_step

    def partial_due(self) -> bool:
        """Whether the next sync may leave out what cannot change."""
        s = self.schedule
        if not s.skip_frozen or self.partials_in_row is None:
            return False
        return s.full_every_k is None or self.partials_in_row + 1 < s.full_every_k

    def synced(self, step: int, partial: bool) -> None:
        self.last_pushed_step = step
        self.partials_in_row = (self.partials_in_row or 0) + 1 if partial else 0

    def failed(self) -> None:
        """After a failed sync the engine may serve another base: the next one is complete."""
        self.partials_in_row = None
