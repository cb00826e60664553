"""When a sync happens, and what it carries: complete, partial, or a delta.

:class:`Schedule` is the configuration (a frozen dataclass, so LightningCLI fills it from a
nested YAML mapping); :class:`SyncClock` is its state over one run. Neither knows about files,
ranks or engines: the callback asks the clock whether a step is due and what kind the next sync
is (:meth:`SyncClock.kind`), and tells it how each sync ended. Every rank keeps its own clock and
feeds it only what every rank agreed on (the outcome of each step, rank zero's byte counts), so
every rank picks the same kind: sharded trainers must all plan the same checkpoint. The keyframe
policy itself (which kind, the delta options) is the library's, shared with
``WeightBridgeTrainer``: :mod:`weight_bridge.delta.keyframes`; the clock adds the steps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from weight_bridge.delta.keyframes import KeyframeClock, delta_mode


@dataclass(frozen=True)
class Schedule:
    """When to sync, and when a sync must be complete.

    Cadence counts optimizer steps (``trainer.global_step``), so gradient accumulation does not
    change it: a sync happens when the step advanced to one that is due (``every_n_train_steps``
    and/or ``at_steps``), before the first step (version = the current step: the engine serves
    the trainer's weights before the first rollout, whatever it was started on), and at the end
    (the final weights, served and saved). No step is pushed twice in one run.

    ``skip_frozen``: after a complete sync, later ones carry only what training can change (a
    *partial* checkpoint, see :mod:`weight_bridge.sync.changed`). The first sync of a run, the
    first after a failed one, and every ``full_every_k``-th (if set) are complete.

    ``delta``: whether a sync may be an exact *delta* (only the values that changed since the
    last push, bit for bit in the engine's dtype). ``"auto"`` (the default): with an engine that
    can apply one, where deltas are measured cheaper than full syncs
    (:mod:`weight_bridge.delta.choice`; each sync's record says why: ``choice``).
    ``"on"``: deltas between keyframes (an engine that cannot refuses by name); ``"off"`` (or
    ``False``): never, for whatever reads each sync's file as the full weights. Deltas rest on
    *keyframes* (complete or partial syncs that refresh the trainer's reference copy), which
    also bound the engine's served chain: when they come is
    :mod:`weight_bridge.delta.keyframes`'s policy. The complete keyframes are the run's
    loadable checkpoints (``VLLMWeightSync.last_checkpoint`` names the newest). With
    ``skip_frozen`` a delta covers only what training can change, like a partial sync.
    """

    every_n_train_steps: int | None = 1
    at_steps: tuple[int, ...] = ()
    skip_frozen: bool = True
    full_every_k: int | None = None
    delta: str = "auto"

    def __post_init__(self) -> None:
        n = self.every_n_train_steps
        if n is not None and n < 1:
            raise ValueError(f"every_n_train_steps must be >= 1 or None, not {n}")
        steps = tuple(sorted(set(self.at_steps or ())))
        if any(s < 0 for s in steps):
            raise ValueError(f"at_steps must be non-negative, not {list(self.at_steps)}")
        object.__setattr__(self, "at_steps", steps)  # normalised: sorted, unique, a tuple
        delta = delta_mode(self.delta, self.full_every_k)
        object.__setattr__(self, "delta", delta)  # YAML's booleans: "on" / "off"

    def due(self, step: int) -> bool:
        """Whether ``step`` is a step the cadence asks for."""
        n = self.every_n_train_steps
        return (n is not None and step % n == 0) or step in self.at_steps


class SyncClock(KeyframeClock):
    """A :class:`Schedule` over one run: which steps to sync, and what kind each sync is (the
    keyframe policy: :class:`~weight_bridge.delta.keyframes.KeyframeClock`).

    ``last_pushed_step`` is the step of the last successful sync (restored on resume).
    """

    def __init__(self, schedule: Schedule) -> None:
        s = schedule
        super().__init__(s.delta, s.full_every_k, skip_frozen=s.skip_frozen)
        self.schedule = schedule
        self.last_pushed_step: int | None = None
        self._seen_step: int | None = None

    def at_train_start(self, step: int) -> bool:
        """A new run: the next sync is complete, and it is now."""
        self._seen_step = step
        self.failed()
        return True

    def at_batch_end(self, step: int) -> bool:
        """Sync when the optimizer step advanced to a due step not yet pushed."""
        advanced = step != self._seen_step
        self._seen_step = step
        return advanced and self.schedule.due(step) and step != self.last_pushed_step

    def at_train_end(self, step: int) -> bool:
        return step != self.last_pushed_step


def in_ranks_schedule(schedule: Schedule) -> Schedule:
    """``schedule`` for an engine in the trainer's ranks, pushed from memory: no deltas (a delta
    saves bytes that travel, and nothing travels; it would read every value to find what
    changed, costing more than the push it replaces). ``"auto"`` means off there; ``"on"`` is
    refused."""
    if schedule.delta == "on":
        raise ValueError(
            "an engine in the trainer's ranks is pushed from the live tensors, where a delta "
            "saves nothing: use delta='off' or 'auto'"
        )
    return dataclasses.replace(schedule, delta="off")
