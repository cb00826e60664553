"""The sender: one sync, run the same way by every trainer-side entry point.

A Lightning callback decides *when* to sync (its schedule), the sender *how*: choose the kind
(complete, partial or a delta: the keyframe clock and what the engine reported, held by
:class:`DeltaState`), give the writer the sink of that kind, let the entry point
stream its tensors into it, push the file, then settle what the sync taught: the clock, the
engine's dtypes, the files to keep (what the engine serves is never deleted) and the loadable
checkpoint. A failure anywhere makes the next sync a keyframe and removes the failed sync's file.

What differs between the entries is handed in, not re-implemented: where the files go and which
are kept (``files``: the callback's transport, :mod:`.transport`, or the trainer API's
:class:`~.retention.StepFiles`), how tensors reach the sink (``write``: the transport's
collective gather across ranks, or a vLLM ``WeightSource``), how the file reaches the engine
(``push``), and how every rank agrees on the writer's numbers (``agree``: the callback
broadcasts rank zero's; a single sender has nothing to agree on). All of it is this package's
or the engine client's: the sender calls nothing of the callback's.
``callbacks.VLLMWeightSync`` and ``WeightBridgeTrainer.send_weights`` both run
:meth:`Sender.send`, so the same training run leaves the same files and the same engine state
through either.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from ..checkpoint.format import BASE_VERSION_KEY
from ..checkpoint.live import LiveCheckpoint
from ..delta.sink import Sink
from ..delta.state import DeltaState


@dataclass(frozen=True)
class Turn:
    """One sync's kind, chosen before anything is written: ``kind`` (``"complete"``,
    ``"partial"`` or ``"delta"``), ``based`` (a keyframe that refreshes the reference copy deltas
    are diffed against), ``metadata`` the file's header must carry (a delta's or a partial
    file's base version), ``choice`` (why: for the record) and ``opener``, which opens the
    sink of that kind (:meth:`DeltaState.open`: a delta's, a keyframe's that
    refreshes the reference copy, or the plain writer's)."""

    kind: str
    based: bool
    metadata: Mapping[str, str]
    choice: Mapping[str, Any]
    opener: Callable[..., Sink]


class Written(NamedTuple):
    """What the writer reports of a sync's file, the same on every rank (``agree``): where to
    push it from, its bytes, whether it leaves out what cannot change (``partial``), and the
    fraction of a delta's elements that changed. ``source``: tensors in memory pushed instead
    of a file (``path`` is then their name), this rank's own."""

    path: str
    nbytes: int
    partial: bool
    changed: float | None = None
    source: LiveCheckpoint | None = None


@dataclass
class Sent:
    """The record of one sync: its ``kind`` as written (``"delta"``, ``"partial"`` or
    ``"complete"``), the file, what the writer reported, the engine's report (None where this
    rank pushed nothing), why it is that kind (``choice``) and what the save and the push took."""

    kind: str
    path: Path
    written: Written
    report: Any
    choice: dict[str, Any]
    save_s: float
    push_s: float
    extra: dict[str, Any] = field(default_factory=dict)


class SyncFiles(Protocol):
    """What the sender asks of where a sync's files go: how the writer writes every file
    (``options``), which are kept after a sync (``retire``: old files go, never what the engine
    serves), a failed sync's file removed (``discard``, unless the engine serves it)."""

    def options(self) -> Mapping[str, Any]: ...

    def retire(self, path: Path, served: Iterable[Any]) -> None: ...

    def discard(self, path: Path) -> None: ...


def _same(value: Any) -> Any:
    return value


class Sender:
    """Runs every sync of one writer (see the module): ``deltas`` (the clock, the engine's
    dtypes, the reference copy) and ``files`` (:class:`SyncFiles`). ``last_checkpoint``: the
    newest complete file, loadable on its own (vLLM and ``transformers`` start on it)."""

    def __init__(self, deltas: DeltaState, files: SyncFiles) -> None:
        self.deltas = deltas
        self.files = files
        self.last_checkpoint: str | None = None

    def turn(self, base: str | None, partial_only: bool = False) -> Turn:
        """The next sync's kind: ``partial_only`` (a send of named tensors, on top of
        ``base``), else what the clock says. No ``base`` (nothing stamped yet): no delta, since
        a delta names its base."""
        clock = self.deltas.clock
        if base is None:
            clock.rebase()
        kind, based = ("partial", False) if partial_only else self.deltas.kind()
        metadata = {BASE_VERSION_KEY: str(base)} if kind != "complete" and base else {}
        opener = partial(self.deltas.open, kind=kind, based=based, options=self.files.options())
        return Turn(kind, based, metadata, self.deltas.why(kind), opener)

    def send(
        self,
        path: Path,
        turn: Turn,
        write: Callable[[Turn], Written],
        push: Callable[[Any], Any],
        agree: Callable[[Any], Any] = _same,
        measured: bool = True,
    ) -> Sent:
        """One sync of ``turn`` (:meth:`turn`): ``write`` streams the file and reports it,
        ``push`` pushes its path or its ``source`` (the engine's report, or None), ``agree``
        makes the writer's numbers every rank's. ``measured``: the sync's cost counts for
        ``delta="auto"`` (a send of named tensors is no full sync). A failure makes the next
        sync a keyframe, removes the written file (unless the engine serves it) and is raised."""
        times = [time.perf_counter()]
        written: Written | None = None
        try:
            written = write(turn)
            times.append(time.perf_counter())
            report = push(Path(written.path) if written.source is None else written.source)
            times.append(time.perf_counter())
        except BaseException:
            self.failed(path if written is not None else None)  # an aborted write left none
            raise
        reported = (dict(getattr(report, "dtypes", None) or {}), times[2] - times[0])
        dtypes, seconds = agree(reported)  # every rank: the writer's
        delta, partial_file = turn.kind == "delta", written.partial and turn.kind != "delta"
        clock = self.deltas.clock
        clock.pushed(partial_file, delta, written.nbytes, turn.based, seconds if measured else None)
        kind = "delta" if delta else "partial" if partial_file else "complete"
        self.deltas.pushed(kind, dtypes)
        if kind == "complete" and written.source is None:  # pushed from memory: no file
            self.last_checkpoint = str(path)
        self.files.retire(Path(written.path), getattr(report, "served", None) or ())
        save_s, push_s = times[1] - times[0], times[2] - times[1]
        return Sent(kind, Path(written.path), written, report, dict(turn.choice), save_s, push_s)

    def failed(self, path: Path | None = None) -> None:
        """A failed sync: the next one is a keyframe in the trainer's dtypes, and its file goes
        (unless the engine serves it)."""
        self.deltas.failed()
        if path is not None:
            self.files.discard(path)
