"""When a sync happens, and what it carries: complete, partial, or a delta.

:class:`Schedule` is the configuration (a frozen dataclass, so LightningCLI fills it from a
nested YAML mapping); :class:`SyncClock` is its state over one run. Neither knows about files,
ranks or engines: the callback asks the clock whether a step is due and what kind the next sync
is (:meth:`SyncClock.kind`), and tells it how each sync ended. Every rank keeps its own clock and
feeds it only what every rank agreed on (the outcome of each step, rank zero's byte counts), so
every rank picks the same kind: sharded trainers must all plan the same checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DELTA_EVERY_K", "DELTA_MODES", "Schedule", "SyncClock"]

DELTA_MODES = ("auto", "on", "off")
DELTA_EVERY_K = 64  # a keyframe every 64 syncs while deltas run, unless full_every_k says


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

    ``delta``: whether a sync may be an exact *delta* (only the values that changed since the
    last push, bit for bit in the engine's dtype; :mod:`callbacks.delta_sink`). ``"auto"``: when the
    engine says it can apply one (its report of the last complete push lists the dtypes it holds
    each tensor in; an engine that does not report cannot); ``"on"``: even so (an engine that cannot
    refuses by name); ``"off"`` (or ``False``, the default for now: tests and tools that read each
    sync's file as the full weights, or bound the files an engine holds to five, assume complete and
    partial syncs): never. Deltas rest on *keyframes* (complete or partial syncs, which also refresh
    the trainer's reference copy): the first sync of a run (a resume included), the first after a
    failed one, every ``full_every_k``-th sync (complete; :data:`DELTA_EVERY_K` = 64 while deltas
    run and ``full_every_k`` is None), and the next sync once the deltas since the last keyframe
    add up to more than ``delta_budget`` times its bytes. With ``skip_frozen`` a delta covers
    only what training can change, like a partial sync.
    """

    every_n_train_steps: int | None = 1
    at_steps: tuple[int, ...] = ()
    push_on_train_start: bool = True
    push_on_train_end: bool = True
    skip_frozen: bool = True
    full_every_k: int | None = None
    delta: str = "off"
    delta_budget: float = 1.0

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
        delta = self.delta
        if isinstance(delta, bool):  # YAML's on/off/true/false arrive as booleans
            delta = "on" if delta else "off"
        if delta not in DELTA_MODES:
            raise ValueError(f"delta must be one of {DELTA_MODES} (or a bool), not {delta!r}")
        object.__setattr__(self, "delta", delta)
        if not self.delta_budget > 0:
            raise ValueError(f"delta_budget must be > 0, not {self.delta_budget}")

    def due(self, step: int) -> bool:
        """Whether ``step`` is a step the cadence asks for."""
        n = self.every_n_train_steps
        return (n is not None and step % n == 0) or step in self.at_steps


class SyncClock:
    """A :class:`Schedule` over one run: which steps to sync, and what kind each sync is.

    ``last_pushed_step`` is the step of the last successful sync (restored on resume);
    ``partials_in_row`` counts the syncs since the last complete one (partial ones and deltas),
    None while the next sync must be complete. ``has_base``: the last push left a reference copy
    a delta can be diffed against (a keyframe written while deltas were on, or a delta);
    ``delta_bytes``: the bytes of the deltas since the last keyframe, of ``keyframe_bytes``.
    """

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.last_pushed_step: int | None = None
        self.partials_in_row: int | None = None
        self.has_base = False
        self.delta_bytes = 0
        self.keyframe_bytes = 0
        self._seen_step: int | None = None

    def at_train_start(self, step: int, resumed: bool) -> bool:
        """A new run: the next sync is complete. Sync now when asked to, or when resumed."""
        self._seen_step = step
        self.failed()
        s = self.schedule
        return s.push_on_train_start or resumed or step in s.at_steps

    def at_batch_end(self, step: int) -> bool:
        """Sync when the optimizer step advanced to a due step not yet pushed."""
        advanced = step != self._seen_step
        self._seen_step = step
        return advanced and self.schedule.due(step) and step != self.last_pushed_step

    def at_train_end(self, step: int) -> bool:
        return self.schedule.push_on_train_end and step != self.last_pushed_step

    def delta_on(self, engine_accepts: bool) -> bool:
        """Whether deltas run: ``delta="on"``, or ``"auto"`` with an engine that accepts them."""
        mode = self.schedule.delta
        return mode == "on" or (mode == "auto" and engine_accepts)

    def kind(self, engine_accepts: bool = False) -> str:
        """The next sync: ``"complete"``, ``"partial"`` (what can change, whole) or ``"delta"``.

        ``engine_accepts``: the engine's last complete push said it can apply deltas."""
        s = self.schedule
        deltas = self.delta_on(engine_accepts)
        every = s.full_every_k if s.full_every_k is not None or not deltas else DELTA_EVERY_K
        if self.partials_in_row is None or (
            every is not None and self.partials_in_row + 1 >= every
        ):
            return "complete"
        if deltas and self.has_base and not self.over_budget():
            return "delta"
        return "partial" if s.skip_frozen else "complete"

    def over_budget(self) -> bool:
        """The deltas since the last keyframe add up past ``delta_budget`` of its bytes."""
        return self.delta_bytes > self.schedule.delta_budget * self.keyframe_bytes

    def partial_due(self) -> bool:
        """Whether the next sync may leave out what cannot change (deltas off)."""
        return self.kind() == "partial"

    def synced(
        self, step: int, partial: bool, delta: bool = False, nbytes: int = 0, based: bool = False
    ) -> None:
        """A sync succeeded on every rank: ``partial`` (what cannot change left out),
        ``delta``, its ``nbytes``; ``based``: a keyframe that refreshed the reference copy."""
        self.last_pushed_step = step
        complete = not partial and not delta
        self.partials_in_row = 0 if complete else (self.partials_in_row or 0) + 1
        if delta:
            self.delta_bytes += nbytes
            return
        self.keyframe_bytes, self.delta_bytes, self.has_base = nbytes, 0, based

    def failed(self) -> None:
        """After a failed sync the engine may serve another base, and the trainer's reference
        copy is not trusted: the next sync is complete."""
        self.partials_in_row = None
        self.rebase()

    def rebase(self) -> None:
        """No delta until the next keyframe (the reference copy is gone or stale, or the
        engine's dtypes changed)."""
        self.has_base = False
        self.delta_bytes = 0
