"""The callback's delta state across syncs: what the engine reported, and the writer's reference.

One job: between the clock (:class:`~callbacks.schedule.SyncClock`: *whether* the next sync is a
delta) and the sinks (:mod:`callbacks.delta_sink`: *how* a delta is written), keep what a run
learns from its engine and its writes:

* the dtype the engine holds each tensor in (``report.dtypes`` of its last complete push; the
  checkpoint's dtype with ``names.dtype="engine"``), the same on every rank (rank zero's, sent
  to all: sharded ranks must plan the same header), and whether the engine can apply deltas
  (it reported them: an engine that does not report cannot);
* on the writer, the reference copy the deltas are diffed against (:mod:`callbacks.reference`),
  and how much the last delta changed.

Nothing here is saved in a Lightning checkpoint: a resumed run starts with a keyframe.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from pathlib import Path

import torch

from .delta_sink import DeltaSink, KeyframeSink, OpenSink, Sink
from .gather import Gatherer, GatherPlan
from .names import ENGINE
from .reference import Reference
from .schedule import SyncClock

__all__ = ["DeltaState"]


class DeltaState:
    """What the engine reported, and the writer's reference copy (see the module)."""

    def __init__(self, gatherer: Gatherer, clock: SyncClock) -> None:
        self.gatherer = gatherer
        self.clock = clock
        self.reference = Reference()
        self.accepts = False  # the engine's last complete push reported its dtypes
        self._delta: DeltaSink | None = None  # the sink of the sync being written

    @property
    def engine_dtypes(self) -> dict[str, str]:
        return self.gatherer.engine_dtypes

    def start(self) -> None:
        """A new run: nothing is known of the engine (the first sync is in the trainer's
        dtype), and the reference is not trusted."""
        self.accepts = False
        self.gatherer.engine_dtypes = {}
        self.reference.invalidate()

    def kind(self) -> tuple[str, bool]:
        """The next sync's kind (:meth:`SyncClock.kind`), and whether it keeps the reference
        (deltas run: ``delta="on"``, or ``"auto"`` with an engine that accepts them)."""
        return self.clock.kind(self.accepts), self.clock.delta_on(self.accepts)

    def opener(self, kind: str, based: bool, plan: GatherPlan) -> OpenSink | None:
        """The sink for this sync: a delta's, a keyframe's (refreshing the reference), or
        None (the plain writer: deltas do not run)."""
        self._delta = None
        options = self.gatherer.writer_options()
        if kind == "delta":
            return self._open_delta
        if based:
            return partial(_keyframe, reference=self.reference, tracked=plan.tracked, **options)
        return None

    def _open_delta(
        self, path: Path, specs: list[tuple[str, torch.Tensor]], metadata: Mapping[str, str]
    ) -> Sink:
        options = self.gatherer.writer_options()
        patchable = frozenset(self.engine_dtypes) if self.engine_dtypes else None
        self._delta = DeltaSink(path, specs, metadata, self.reference, options, patchable)
        return self._delta

    def changed_fraction(self) -> float | None:
        """The fraction of the delta's elements that changed (None: not a delta, or not the
        writer)."""
        sink, self._delta = self._delta, None
        if sink is None:
            return None
        return sink.changed / sink.numel if sink.numel else 0.0

    def pushed(self, kind: str, dtypes: Mapping[str, str]) -> None:
        """After a successful sync, on every rank: what the engine reported (rank zero's
        ``report.dtypes``). A complete push's report replaces what is known (empty: the engine
        does not report, so it takes no delta); a partial one's adds to it. A change of the
        dtypes a checkpoint is written in makes the next sync a keyframe."""
        if kind == "delta":
            return
        known = dict(dtypes) if kind == "complete" else {**self.engine_dtypes, **dtypes}
        if kind == "complete":
            self.accepts = bool(known)
        if known != self.engine_dtypes:
            self.gatherer.engine_dtypes = known
            if self.gatherer.names.dtype == ENGINE:
                self.clock.rebase()

    def failed(self) -> None:
        """A failed save or push: the reference may be unlike what the engine serves."""
        self._delta = None
        self.reference.invalidate()

    def release(self) -> None:
        """The run is over: the reference's host memory goes."""
        self._delta = None
        self.reference.clear()


def _keyframe(
    path: Path,
    specs: list[tuple[str, torch.Tensor]],
    metadata: Mapping[str, str],
    reference: Reference,
    tracked: frozenset[str] | None,
    **options: object,
) -> Sink:
    return KeyframeSink(path, specs, metadata, reference, tracked, options)
