"""A writer's delta state across syncs: the clock, what the engine reported, the reference copy.

One job, shared by both trainer-side writers (the Lightning callback, ``WeightBridgeTrainer``):
between the clock (:class:`~.keyframes.KeyframeClock`: *whether* the next sync is a delta) and
the sinks (:mod:`.sink`: *how* a delta is written), keep what a run learns from its engine
and its writes:

* the dtype the engine holds each tensor in (:class:`~.keyframes.EngineDtypes`: ``report.dtypes``
  of its last complete push; the checkpoint's dtype where the writer follows the engine), and
  whether the engine can apply deltas (it reported them: an engine that does not report cannot);
* on the writer, the reference copy the deltas are diffed against (:mod:`.reference`: host
  memory, one copy of the tracked tensors in the engine's dtype), and how much the last delta
  changed.

Nothing here is saved: a resumed run, or a restarted trainer, starts with a keyframe.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.write import CheckpointWriter
from .choice import DeltaChoice, host_memory_transport
from .keyframes import EngineDtypes, KeyframeClock
from .reference import Reference
from .sink import DeltaSink, KeyframeSink, Sink


class DeltaState:
    """The clock, what the engine reported (``engine``; the writer's own, or one it shares) and
    the writer's reference copy (see the module). ``follows_engine``: checkpoints are written in
    the engine's dtypes, so a change of them makes the next sync a keyframe."""

    def __init__(
        self, clock: KeyframeClock, engine: EngineDtypes | None = None, follows_engine: bool = True
    ) -> None:
        self.clock = clock
        self.engine = engine if engine is not None else EngineDtypes()
        self.follows_engine = follows_engine
        self.reference = Reference()
        self._delta: DeltaSink | None = None  # the sink of the sync being written

    @property
    def accepts(self) -> bool:
        """The engine's last complete push reported its dtypes (it can apply deltas)."""
        return self.engine.accepts

    def start(self, directory: Path | str) -> None:
        """A new run writing into ``directory``: nothing is known of the engine (the first
        sync is in the trainer's dtype), the reference is not trusted, and ``delta="auto"``
        measures afresh on this transport (:func:`~.choice.host_memory_transport`)."""
        self.engine.forget()
        self.reference.invalidate()
        self.clock.choice = DeltaChoice(host_memory_transport(directory))

    def kind(self) -> tuple[str, bool]:
        """The next sync's kind (:meth:`KeyframeClock.kind`), and whether it keeps the reference
        (deltas run: ``delta="on"``, or ``"auto"`` with an engine that accepts them)."""
        return self.clock.kind(self.accepts), self.clock.delta_on(self.accepts)

    def why(self, kind: str) -> dict[str, Any]:
        """Why the sync :meth:`kind` just chose is ``kind`` (for the sync's record)."""
        return self.clock.described(kind)

    def open(
        self,
        path: Path,
        specs: list[tuple[str, torch.Tensor]],
        metadata: Mapping[str, str],
        *,
        kind: str,
        based: bool,
        options: Mapping[str, Any],
        tracked: frozenset[str] | None = None,
    ) -> Sink:
        """The sink of this sync's file (``options``: the writer's): a delta's (``metadata``
        names its base version; a tensor the engine did not report goes dense), a keyframe's
        (``based``: fingerprinted, refreshing the reference copy of ``tracked``, None: every
        tensor), or the plain writer (deltas do not run: the reference is not trusted after
        it)."""
        self._delta = None
        if kind == "delta":
            patchable = frozenset(self.engine.known) if self.engine.known else None
            self._delta = DeltaSink(path, specs, metadata, self.reference, options, patchable)
            return self._delta
        if based:
            return KeyframeSink(path, specs, metadata, self.reference, tracked, options)
        self.reference.invalidate()
        return CheckpointWriter(path, specs, metadata, **options)

    def changed_fraction(self) -> float | None:
        """The fraction of the delta's elements that changed (None: not a delta, or not the
        writer)."""
        sink, self._delta = self._delta, None
        if sink is None:
            return None
        return sink.changed / sink.numel if sink.numel else 0.0

    def pushed(self, kind: str, dtypes: Mapping[str, str]) -> None:
        """After a successful sync, on every rank: what the engine reported (``report.dtypes``
        of the writer's push; :meth:`EngineDtypes.pushed`). A change of the dtypes a checkpoint
        is written in makes the next sync a keyframe."""
        if self.engine.pushed(kind, dtypes) and self.follows_engine:
            self.clock.rebase()

    def failed(self) -> None:
        """A failed save or push: the engine may serve another base, and the reference may be
        unlike what it serves; the engine itself may be another (restarted in other dtypes).
        The next sync is complete, in the trainer's dtypes, and what its push reports is what
        the syncs after it follow (a keyframe written in the old engine's dtypes would not be
        what the new one holds)."""
        self._delta = None
        self.clock.failed()
        self.reference.invalidate()
        self.engine.forget()

    def release(self) -> None:
        """The run is over: the reference's host memory goes."""
        self._delta = None
        self.reference.clear()
