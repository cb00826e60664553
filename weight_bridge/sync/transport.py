"""How a sync's tensors reach the engine: a transport, chosen once from the engine.

Shaped like Lightning's ``CheckpointIO`` beside ``ModelCheckpoint``: the callback's schedule
says *when*, the sender (:class:`~weight_bridge.sync.Sender`) *what kind* of sync, the
transport *how* the tensors travel and what is left on disk. The sender holds it (``options``,
``retire``, ``discard``) and runs its ``write`` and ``push`` (the engine's push, then the
canary); the callback calls ``pushed`` (every rank, after a push landed) and ``end`` (after
every sync), whatever it is. It calls nothing of the callback's.

* :class:`FileTransport` (an engine of its own process, a server, one the user built): the
  writer ranks stream a safetensors file per sync into the sync's directory (in RAM or on
  disk), or a PEFT policy's adapter directory (:mod:`.adapter`); every rank pushes its path;
  old files are pruned (never what the engine serves), a failed sync's file removed.
* :class:`LiveTransport` (``EngineSpec(mode="ranks")``: vLLM inside the trainer's ranks): every
  rank pushes its own tensors, the object itself
  (:class:`~weight_bridge.checkpoint.live.LiveCheckpoint` of
  :class:`~weight_bridge.checkpoint.live.LiveTensor` s: not copied; a DTensor gathered only
  when the engine's loader asks for it, one at a time). No file, unless the user asks
  (``files.dirpath``): then each sync also saves a complete checkpoint there, from the same
  gathers (:class:`_FileCopy`, the source wrapped: what the push carries as the engine's loader
  takes it; what a partial push leaves out, after it), the newest kept.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import CheckpointWriter
from ..checkpoint.live import LiveCheckpoint
from ..delta.state import DeltaState
from .adapter import AdapterPlan, write_adapter
from .canary import CanaryCheck
from .collective import Collective
from .gather import Gatherer, GatherPlan
from .names import SyncEntry
from .retention import CheckpointFiles
from .sender import Turn, Written


@dataclass
class SyncStep:
    """One sync as a transport sees it: the trainer's objects, the step's file (a live push
    keeps it for the copy the user asked for), the ranks' agreement, and the canary's logprob
    gap once pushed (None: no canary, or no engine on this rank)."""

    trainer: Any
    pl_module: Any
    path: Path
    step: int
    collective: Collective
    gap: float | None = None

    def metadata(self, plan: GatherPlan, turn: Turn) -> dict[str, str]:
        """The checkpoint's header fields: its version, and a partial one's or a delta's base."""
        metadata = {"step": str(self.step), "version": str(self.step)}
        metadata["source_dtype"] = plan.source_dtype
        if plan.partial or turn.kind == "delta":
            metadata.update(turn.metadata)
        return metadata


class Transport(ABC):
    """What every transport answers (see the module). ``writer``: this rank writes files;
    ``file_ranks``: the ranks that do; ``engine``: the engine now (None before it starts, and
    on a rank without one); ``canary``: the check after each push (None: none)."""

    def __init__(
        self,
        gatherer: Gatherer,
        files: CheckpointFiles,
        deltas: DeltaState,
        canary: CanaryCheck | None = None,
    ) -> None:
        self.gatherer, self.files, self.deltas, self.canary = gatherer, files, deltas, canary
        self.directory: Path | None = None
        self.in_ram = False
        self.writer = False
        self.file_ranks: list[int] = [0]
        self.engine: Any = None
        self.adapter: AdapterPlan | None = None  # a PEFT policy's: adapter or merged syncs

    def setup(self, directory: Path, in_ram: bool, file_ranks: list[int], writer: bool) -> None:
        self.directory, self.in_ram = directory, in_ram
        self.file_ranks, self.writer = file_ranks, writer

    def options(self) -> dict[str, Any]:
        """The sender's: how every file of a sync is written."""
        return self.gatherer.writer_options()

    @abstractmethod
    def write(self, sync: SyncStep, turn: Turn) -> Written:
        """The sender's ``write``: the sync's tensors made ready to push (the same on every
        rank: every rank pushes what this names)."""

    def push(self, sync: SyncStep, where: Any) -> Any:
        """The sender's, every rank: ``where`` (a path, or live tensors) into the engine, then
        the canary's check (``sync.gap``), each agreed; the engine's report (None: no engine)."""
        engine = self.engine
        report = sync.collective.run("push", partial(_push, engine, where, sync.step))
        sync.gap = sync.collective.run("canary", partial(self._check, engine, sync.pl_module))
        return report

    def _check(self, engine: Any, pl_module: Any) -> float | None:
        if self.canary is None or engine is None:
            return None
        return self.canary.gap(self.gatherer.model(pl_module), engine)

    def pushed(self, sync: SyncStep) -> str | None:
        """Every rank, after the push landed: the complete file this sync left (None: none
        beyond what the sender knows)."""
        return None

    @abstractmethod
    def retire(self, path: Path, served: Iterable[Any]) -> None:
        """The sender's, after a sync: old files go, except what the engine serves."""

    @abstractmethod
    def discard(self, path: Path) -> None:
        """The sender's, after a failed sync: its file goes (unless the engine serves it)."""

    @abstractmethod
    def end(self) -> None:
        """After every sync, landed or not: nothing it made outlives it."""


class FileTransport(Transport):
    """A file per sync, written by the writer ranks, pushed by path (see the module)."""

    def write(self, sync: SyncStep, turn: Turn) -> Written:
        written = sync.collective.run("save", partial(self._save, sync, turn))
        written = sync.trainer.strategy.broadcast(written, src=0)
        # each node's writer wrote its own copy (node_local): push and keep that one
        return written._replace(path=str(sync.path)) if self.files.node_local else written

    def _save(self, sync: SyncStep, turn: Turn) -> Written:
        """Plan the checkpoint of ``turn``'s kind (every rank) and stream it (writers;
        sharded: every rank): a delta between keyframes when deltas run, else complete or
        partial; a PEFT policy's adapter where it pushes one (:mod:`.adapter`)."""
        if self.adapter is not None and self.adapter.pushes:
            meta = {"step": str(sync.step), "version": str(sync.step)}  # on the base: no base
            model = self.gatherer.model(sync.pl_module)
            fsync = self.gatherer.fsync
            nbytes = write_adapter(model, sync.path, meta, fsync) if self.writer else 0
            return Written(str(sync.path), nbytes, True)
        kind = turn.kind
        skip_frozen = self.deltas.clock.skip_frozen
        changing = kind == "partial" or (kind == "delta" and skip_frozen)
        track = turn.based and kind != "delta"
        plan = self.gatherer.plan(sync.trainer, sync.pl_module, changing, self.writer, track)
        sink = partial(turn.opener, tracked=plan.tracked)
        where = sync.path if self.writer else None
        metadata = sync.metadata(plan, turn)
        saved = self.gatherer.stream(plan, where, metadata, sync.collective, self.file_ranks, sink)
        nbytes = saved.bytes if saved else 0
        return Written(str(sync.path), nbytes, plan.partial, self.deltas.changed_fraction())

    def retire(self, path: Path, served: Iterable[Any]) -> None:
        if self.writer and self.directory is not None:
            self.gatherer.retire(self.directory, path, self.files.keep(self.in_ram), served)

    def discard(self, path: Path) -> None:
        if self.writer:
            self.gatherer.discard(path, self.engine)

    def end(self) -> None:
        """Nothing to release: the file is the sender's to keep or discard."""


@dataclass
class _FileCopy(LiveCheckpoint):
    """The tensors a live sync pushes, wrapped: each one the push produces is also written to
    the complete file the user asked for (its writer: None, not this rank's), then the entries
    the push does not carry; the first error writing it met stops the copy, not the push (it
    fails the sync once the push ended)."""

    writer: CheckpointWriter | None = None
    rest: list[SyncEntry] = field(default_factory=list)
    sharded: bool = False
    error: BaseException | None = None

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in super().stream():
            if self.writer is not None and self.error is None:
                try:
                    self.writer.write(name, tensor, cast=True)
                except Exception as exc:
                    self.error = exc
            yield name, tensor


class LiveTransport(Transport):
    """Every rank's live tensors, pushed as they are (see the module)."""

    _copy: _FileCopy | None = None  # this sync's copy into the file the user asked for

    def write(self, sync: SyncStep, turn: Turn) -> Written:
        return sync.collective.run("save", partial(self._source, sync, turn))

    def _source(self, sync: SyncStep, turn: Turn) -> Written:
        gatherer = self.gatherer
        plan = gatherer.plan(sync.trainer, sync.pl_module, turn.kind == "partial", True)
        if plan.sharded:  # each gather is a collective: every rank streams the same tensors
            sync.collective.same("push (the checkpoint's tensors)", plan.digest())
        items = [gatherer.live_tensor(e) for e in plan.entries]
        source = LiveCheckpoint(items, sync.metadata(plan, turn))
        if self.files.dirpath is not None:
            source = self._copy = self._open_copy(sync, plan, source)
        nbytes = sum(t.numel() * t.element_size() for t in items)
        return Written(source.path, nbytes, plan.partial, source=source)

    def _open_copy(self, sync: SyncStep, plan: GatherPlan, source: LiveCheckpoint) -> _FileCopy:
        """``source`` wrapped with the complete file's writer, its header ordered as its tensors
        come: what the push streams, then what a partial push leaves out."""
        complete = plan
        if plan.partial:
            complete = self.gatherer.plan(sync.trainer, sync.pl_module, False, True)
        carried = {e.name for e in plan.entries}
        rest = [e for e in complete.entries if e.name not in carried]
        writer = None
        if self.writer:
            header = GatherPlan([*plan.entries, *rest], False, complete.source_dtype, False)
            meta = {"step": str(sync.step), "version": str(sync.step)}
            meta["source_dtype"] = complete.source_dtype
            writer = CheckpointWriter(sync.path, header.specs(), meta, **self.options())
        return _FileCopy(
            source.items, source.metadata, writer=writer, rest=rest, sharded=complete.sharded
        )

    def pushed(self, sync: SyncStep) -> str | None:
        copy = self._copy
        if copy is None:
            return None
        self._copy = None
        try:
            self.gatherer.write_entries(
                copy.rest, copy.sharded, copy.writer, self.file_ranks, sync.collective, copy.error
            )
            if copy.writer is not None:
                copy.writer.finish()
        except BaseException:
            if copy.writer is not None:
                copy.writer.abort()
            raise
        if self.writer and self.directory is not None:
            self.gatherer.retire(self.directory, sync.path, self.files.keep(self.in_ram), ())
        return str(sync.path)

    def retire(self, path: Path, served: Iterable[Any]) -> None:
        """Nothing: a live push leaves no file (the copy the user asked for is kept by
        :meth:`pushed`)."""

    def discard(self, path: Path) -> None:
        """Nothing: a live push leaves no file."""

    def end(self) -> None:
        copy, self._copy = self._copy, None
        if copy is not None and copy.writer is not None:
            copy.writer.abort()  # the sync failed before its copy was finished


def _push(engine: Any, where: Any, step: int) -> Any:
    return None if engine is None else engine.push(where, version=step)


def transport_for(in_ranks: bool) -> type[Transport]:
    """The transport of an engine: in the trainer's ranks, live tensors; else files."""
    return LiveTransport if in_ranks else FileTransport
