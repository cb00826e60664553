"""The gatherer: what a sync sends, and how each tensor reaches the checkpoint's writer.

A sync first *plans* from metadata alone (names, shapes, dtypes, ``requires_grad``, module
structure): which checkpoint tensors, made of which trainer tensors (:mod:`.changed`),
under which names and dtypes (:mod:`.names`). The plan is the checkpoint's header, so
the writer (:class:`~weight_bridge.checkpoint.CheckpointWriter`) opens before any tensor is
gathered. Then each tensor is produced in header order, written at its offset and freed (the
writer casts it to the checkpoint's dtype chunk by chunk as it writes: no full-size cast copy).

Replicated trainers (one device, DDP) hold every tensor on every rank: the writer streams them
and the other ranks do nothing. Sharded trainers (FSDP2 through ``ModelParallelStrategy``: the
state holds DTensors) need every rank in every gather: each rank plans the same header (checked:
a digest of rank zero's plan), and for each tensor the ranks prepare locally, agree that all are
ready, gather (:mod:`weight_bridge.checkpoint.dtensor`), after which the writers merge, cast and
write. Any
local failure (a shard that does not fit, a buffer that cannot be allocated, a full disk) is
reported at the next agreement, so every rank stops at the same tensor: nobody waits in a
gather that will not come, the writer's temporary file is removed, and the file at the final
path is never half-written. The writer's peak extra memory is one full tensor (its cast goes
through a 4 MiB buffer), not the model. An engine in the trainer's ranks is not written to:
each entry becomes a :class:`~weight_bridge.checkpoint.live.LiveTensor` (:meth:`Gatherer.
live_tensor`), gathered the same way when the engine's loader asks for it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import SavedCheckpoint, TransportMaps, create_reserved
from ..checkpoint.dtensor import ShardGather, is_dtensor
from ..checkpoint.live import LiveTensor
from ..delta.keyframes import EngineDtypes
from ..delta.sink import OpenSink, Sink
from .changed import sync_state
from .collective import Collective
from .names import CheckpointNames, SyncEntry
from .retention import SPARE, discard, estimate_bytes, prune


@dataclass(frozen=True)
class GatherPlan:
    """The checkpoint to write, from metadata; ``sharded``: every rank takes part;
    ``tracked``: the names a delta may later touch (None: every entry), for the reference copy
    a keyframe refreshes (:mod:`weight_bridge.delta.reference`)."""

    entries: list[SyncEntry]
    partial: bool
    source_dtype: str
    sharded: bool
    tracked: frozenset[str] | None = None

    def specs(self) -> list[tuple[str, torch.Tensor]]:
        """The header: each name with a data-less tensor of its shape and dtype."""
        return [(e.name, torch.empty(e.shape, dtype=e.dtype, device="meta")) for e in self.entries]

    def digest(self) -> str:
        text = "\n".join(f"{e.name} {list(e.shape)} {e.dtype}" for e in self.entries)
        return hashlib.sha256(f"{self.partial}\n{text}".encode()).hexdigest()


class Gatherer:
    """Plans a sync's checkpoint and streams it into the writer, one tensor at a time.

    The state comes from ``source(pl_module)`` if given, else from
    ``getattr(pl_module, module_attr)`` (``module_attr=""``: the LightningModule itself; for a
    replicated one through the strategy, which gathers sharded states of strategies that do not
    use DTensors, such as ``FSDPStrategy``).
    """

    def __init__(
        self,
        names: CheckpointNames,
        module_attr: str,
        source: Callable | None,
        fsync: bool = True,
    ) -> None:
        self.names = names
        self.module_attr = module_attr
        self.source = source
        self.fsync = fsync  # checkpoints are fsynced (durable) or not (transport)
        self.hashed = True  # the content hash in the header (the RAM transport: only to check)
        self.spare: Path | None = None  # a file whose pages the writer reuses (RAM transport)
        self.maps: TransportMaps | None = None  # the files' maps, kept across syncs (same)
        self.owner: int | None = None  # holds the RAM transport's directory while the run lives
        self.engine = EngineDtypes()  # what the engine reported holding (names.dtype="engine")

    def writer_options(self) -> dict[str, Any]:
        """How every file of a sync is written (a keyframe's, a delta's, a plain one's)."""
        return {"fsync": self.fsync, "hashed": self.hashed, "reuse": self.spare, "maps": self.maps}

    def use_ram(self, directory: Path | None, owner: int | None = None) -> None:
        """Write into the RAM transport in ``directory`` (None: not in RAM, or no more): its
        spare file, and the maps of its files, kept from one sync to the next; ``owner``: the
        descriptor that holds the run's directory (:func:`~weight_bridge.sync.run_dirs.
        claim`), closed when the transport is left."""
        if self.maps is not None:
            self.maps.close()
        if self.owner is not None:
            os.close(self.owner)
        self.spare = directory / SPARE if directory is not None else None
        self.maps = TransportMaps() if directory is not None else None
        self.owner = owner

    def retire(self, directory: Path, current: Path, keep: int, served: Iterable) -> None:
        """After a sync: delete the old files (in RAM the first to go becomes the spare), drop
        the maps of deleted files now (not at the next sync), and, after the first sync, make
        the spare."""
        prune(directory, current, keep, served, spare=self.spare is not None)
        if self.maps is not None:
            self.maps.drop_unlinked()
        self.prepare_spare(current)

    def discard(self, path: Path, engine: Any) -> None:
        """A failed sync's file goes (unless the engine serves it), and its map with it."""
        discard(path, engine)
        if self.maps is not None:
            self.maps.drop_unlinked()

    def prepare_spare(self, like: Path) -> None:
        """Give the RAM transport its spare file now (after the first sync), the size of
        ``like``, every page allocated and touched once through the kept map: the second sync
        then writes as fast as the later ones, instead of paying for fresh pages (allocating,
        zeroing and faulting them in costs several times the copy). Best effort: without room
        there is no spare, and the next sync writes a new file (and says so if it fails)."""
        if self.spare is None or self.spare.exists() or not like.is_file():
            return  # (an adapter's directory is no file to recycle)
        size = like.stat().st_size
        fd = create_reserved(self.spare, size)
        if fd is None:
            return
        try:
            if self.maps is not None:
                self.maps.view(fd, size).zero_()
        except (OSError, ValueError):
            pass  # not mapped: the next write maps it (or writes it)
        finally:
            os.close(fd)

    def model(self, pl_module: Any) -> torch.nn.Module:
        """The module the checkpoint is of (what the canary scores): the source attribute's;
        with a source function, the LightningModule's ``model`` where it has one (the usual
        home of a Hugging Face model), else the LightningModule."""
        if self.module_attr:
            return getattr(pl_module, self.module_attr)
        if self.source is not None:
            return getattr(pl_module, "model", pl_module)
        return pl_module

    def estimate_bytes(self, pl_module: Any) -> int:
        """One checkpoint's size from the model's metadata (0 if it is not built yet)."""
        try:
            if self.source is not None:
                state = self.source(pl_module)
            else:
                state = self.model(pl_module).state_dict(keep_vars=True)
        except Exception:  # a model built later (configure_model), or a source not ready
            return 0
        return estimate_bytes(state, self.names.fixed_dtype)  # "engine": the trainer's at first

    def _state(self, trainer: Any, pl_module: Any) -> tuple[torch.nn.Module | None, Mapping]:
        if self.source is not None:
            return None, self.source(pl_module)
        root = self.model(pl_module)
        if not self.module_attr and not any(is_dtensor(p) for p in root.parameters()):
            return root, trainer.strategy.lightning_module_state_dict()
        return root, root.state_dict()

    def plan(
        self, trainer: Any, pl_module: Any, changing_only: bool, writer: bool, track: bool = False
    ) -> GatherPlan:
        """Every rank calls this (the state dict call may be collective). Ranks that neither
        write nor take part in gathers get an empty plan. ``track``: name what deltas will
        carry (with ``changing_only`` off: only what training can change)."""
        root, state = self._state(trainer, pl_module)
        sharded = any(is_dtensor(t) for t in state.values())
        if not sharded and not writer:
            return GatherPlan([], False, "", False)
        selected = sync_state(root, state, changing_only)
        entries, source_dtype = self.names.entries(selected, self.engine.known)
        tracked = None
        if track and not changing_only:
            changing = self.names.entries(sync_state(root, state, True), self.engine.known)[0]
            tracked = frozenset(e.name for e in changing)
        return GatherPlan(entries, selected.partial, source_dtype, sharded, tracked)

    def stream(
        self,
        plan: GatherPlan,
        path: Path | None,
        metadata: Mapping[str, str],
        collective: Collective,
        writers: Sequence[int],
        open_sink: OpenSink,
    ) -> SavedCheckpoint | None:
        """Write ``plan`` to ``path`` (None: this rank does not write) through the sink
        ``open_sink`` makes (the sync's kind: :class:`~weight_bridge.sync.Turn`). Sharded
        plans need every rank here; a failure anywhere raises ``StepFailed`` on every rank at
        the same tensor."""
        if plan.sharded:
            collective.same("save (the checkpoint's tensors)", plan.digest())
        error: BaseException | None = None
        writer: Sink | None = None
        try:
            try:
                if path is not None:
                    writer = open_sink(path, plan.specs(), metadata)
            except Exception as exc:
                error = exc
            self.write_entries(plan.entries, plan.sharded, writer, writers, collective, error)
            return writer.finish() if writer is not None else None
        except BaseException:
            if writer is not None:
                writer.abort()
            raise

    def write_entries(
        self,
        entries: Sequence[SyncEntry],
        sharded: bool,
        sink: Sink | None,
        writers: Sequence[int],
        collective: Collective,
        error: BaseException | None = None,
    ) -> None:
        """Each of ``entries`` gathered (sharded: every rank, agreeing before each) and written
        into ``sink`` (None: this rank writes nothing); ``error``: this rank's failure so far.
        The first local error is raised once every rank stopped at the same tensor."""
        for entry in entries:
            error = self._one(entry, sharded, sink, writers, collective, error)
        if error is not None:
            raise error

    @staticmethod
    def live_tensor(entry: SyncEntry) -> LiveTensor:
        """``entry`` for an engine in the trainer's ranks: its trainer tensors (not copied,
        not gathered), merged and cast when the engine's loader asks for it."""
        item = entry.item
        return LiveTensor(entry.name, entry.shape, entry.dtype, item.sources, item.merge)

    def _one(
        self,
        entry: SyncEntry,
        sharded: bool,
        writer: Sink | None,
        writers: Sequence[int],
        collective: Collective,
        error: BaseException | None,
    ) -> BaseException | None:
        """One tensor: prepare (local), agree (sharded), gather, then merge, cast and write.

        Returns the first local error so far; it is raised at the next agreement."""
        if not sharded and (writer is None or error is not None):
            return error  # replicated: nothing to gather, nobody to wait for us
        gathers: list[Any] = []
        if error is None:
            try:
                gathers = [self._prepare(t, writers) for t in entry.item.sources]
            except Exception as exc:
                error = exc
        if sharded:
            collective.agree("save", error)  # every rank ready, or every rank stops here
        if error is not None:
            return error
        try:
            full = [g.run() if isinstance(g, ShardGather) else g for g in gathers]
            del gathers
            if writer is not None:
                tensor = self._combine(entry, full)
                del full
                # cast, copied off the device, hashed and written in one pass, chunk by chunk
                # (a delta's sink: cast, diffed against the reference copy as it arrives)
                writer.write(entry.name, tensor.detach(), cast=True)
        except Exception as exc:
            return exc
        return None

    @staticmethod
    def _combine(entry: SyncEntry, full: list[torch.Tensor | None]) -> torch.Tensor:
        """On a writer: the checkpoint tensor from its gathered sources (a LoRA merge)."""
        tensors = [t for t in full if t is not None]
        if len(tensors) != len(full):
            raise RuntimeError(f"{entry.name}: a source was not gathered onto this writer")
        merge = entry.item.merge
        return merge(tensors) if merge is not None else tensors[0]

    @staticmethod
    def _prepare(t: torch.Tensor, writers: Sequence[int]) -> ShardGather | torch.Tensor:
        if is_dtensor(t):
            return ShardGather(t, writers).prepare()
        return t
