"""Where a sync's tensors go on the writer when deltas run: a keyframe or a delta file.

The writer of a sync (the Lightning callback's gatherer, ``WeightBridgeTrainer``'s sender)
hands each tensor, as it is gathered, to a *sink* (:class:`Sink`: ``write`` in header order,
then ``finish`` or ``abort``). Without deltas the sink is the
:class:`~weight_bridge.checkpoint.CheckpointWriter` itself. With them:

* :class:`KeyframeSink` (a complete or partial sync): the plain streamed file, whose header also
  carries every tensor's exact fingerprint (:data:`~weight_bridge.delta.format.
  FINGERPRINTS_KEY`: the engine's base fingerprints). The header is written before any tensor
  is gathered, so it holds a placeholder of the same length, filled in before the rename
  (:class:`FingerprintedWriter`). Each tracked tensor is cast into the reference copy
  (:mod:`.reference`) and written from there: one cast, one copy off the device.
* :class:`DeltaSink`: the header depends on what changed, so nothing is written until every
  tensor was diffed; it keeps each tensor's encoded change (O(changed); a dense one is the
  reference's own tensor) and writes the delta file at :meth:`~DeltaSink.finish`, with the same
  writer (atomic, hashed or not, the RAM transport's spare file and maps).

Either way an abort leaves no file and invalidates the reference: the next sync is a keyframe.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from ..checkpoint.format import BASE_VERSION_KEY, VERSION_KEY
from ..checkpoint.header_plan import plan_header
from ..checkpoint.write import CheckpointWriter, SavedCheckpoint
from ..exact import format_fingerprint
from .format import BASE_LINEAGE_KEY, FINGERPRINTS_KEY, delta_metadata, lineage_of, part_name
from .reference import Change, Reference, cast_fingerprint


class Sink(Protocol):
    """What the gatherer writes a sync's tensors into, in header order."""

    def write(self, name: str, tensor: torch.Tensor, cast: bool = False) -> None: ...

    def finish(self) -> SavedCheckpoint: ...

    def abort(self) -> None: ...


# (path, header: [(name, meta tensor)], metadata) -> a sink
OpenSink = Callable[[Path, list[tuple[str, torch.Tensor]], Mapping[str, str]], Sink]


def _prints_json(prints: Mapping[str, int]) -> str:
    return json.dumps({n: format_fingerprint(v) for n, v in prints.items()}, separators=(",", ":"))


class FingerprintedWriter(CheckpointWriter):
    """A :class:`CheckpointWriter` whose header also records each tensor's fingerprint, known
    only once the tensor was written: the header is planned with 16 zero digits per tensor and
    rewritten in place (same length: a fingerprint is always 16 hex digits, which JSON never
    escapes) before the file is renamed into place, so no reader sees the placeholder."""

    def __init__(
        self,
        path: str | os.PathLike,
        specs: list[tuple[str, torch.Tensor]],
        metadata: Mapping[str, str],
        **options: Any,
    ) -> None:
        self._specs = list(specs)
        self._meta = dict(metadata)
        self._hashed = options.get("hashed", True)
        self.fingerprints: dict[str, int] = {}
        placeholder = _prints_json({n: 0 for n, _ in self._specs})
        super().__init__(
            path, self._specs, {**self._meta, FINGERPRINTS_KEY: placeholder}, **options
        )

    def _commit(self, digest: str) -> None:
        missing = [n for n, _ in self._specs if n not in self.fingerprints]
        if missing:
            self._refuse("no fingerprint recorded", missing[0])
        prints = {n: self.fingerprints[n] for n, _ in self._specs}
        meta = {**self._meta, FINGERPRINTS_KEY: _prints_json(prints)}
        _, head, _ = plan_header(self.path, self._specs, meta, self._hashed)
        if len(head) != self._total - self.nbytes:  # cannot happen: hex digits never escape
            self._refuse("the fingerprints changed the header's length", self._specs[0][0])
        os.pwrite(self._file.fileno(), head, 0)  # the hash goes in after, at its own offset
        super()._commit(digest)


class KeyframeSink:
    """A complete (or partial) sync while deltas run: streamed like any, fingerprinted, and the
    tracked tensors (None: all) refresh the reference copy."""

    def __init__(
        self,
        path: Path,
        specs: list[tuple[str, torch.Tensor]],
        metadata: Mapping[str, str],
        reference: Reference,
        tracked: frozenset[str] | None,
        options: Mapping[str, Any],
    ) -> None:
        self.reference = reference
        self.tracked = tracked
        self._dtypes = {n: t.dtype for n, t in specs}
        # a partial keyframe applies on top of the weights last written: their lineage
        self._on_top = BASE_VERSION_KEY in metadata
        self._base_lineage = reference.lineage if self._on_top else None
        if self._base_lineage is not None:
            metadata = {**metadata, BASE_LINEAGE_KEY: self._base_lineage}
        reference.invalidate()  # refreshed tensor by tensor; valid again only at finish
        self.writer = FingerprintedWriter(path, specs, metadata, **options)
        self._kept: list[str] = []

    def write(self, name: str, tensor: torch.Tensor, cast: bool = False) -> None:
        dtype = self._dtypes.get(name, tensor.dtype)
        if name in self._dtypes and (self.tracked is None or name in self.tracked):
            held = self.reference.store(name, tensor, dtype)
            self.writer.write(name, held)
            self.writer.fingerprints[name] = self.reference.fingerprint(name) or 0
            self._kept.append(name)
        else:
            self.writer.write(name, tensor, cast=cast)  # refuses an unknown name by itself
            self.writer.fingerprints[name] = cast_fingerprint(tensor, dtype)

    def finish(self) -> SavedCheckpoint:
        try:
            saved = self.writer.finish()
        except BaseException:
            self.abort()
            raise
        self.reference.keep_only(self._kept)
        prints = self.writer.fingerprints
        if not self._on_top:
            self.reference.lineage = lineage_of(None, prints)
        elif self._base_lineage is not None:
            self.reference.lineage = lineage_of(self._base_lineage, prints)
        return saved

    def abort(self) -> None:
        self.writer.abort()
        self.reference.invalidate()


class DeltaSink:
    """A delta: each tensor diffed against the reference as it arrives, the file written at
    :meth:`finish` (tensors that did not change are left out; if none did, a valid delta with
    no tensors). ``metadata`` must name the base version already. ``patchable``: the tensors
    the engine can patch element by element (None: any); a changed tensor outside it is
    carried dense, since the engine rebuilds it whole and refuses a sparse one."""

    def __init__(
        self,
        path: Path,
        specs: list[tuple[str, torch.Tensor]],
        metadata: Mapping[str, str],
        reference: Reference,
        options: Mapping[str, Any],
        patchable: frozenset[str] | None = None,
    ) -> None:
        self.path = path
        self.patchable = patchable
        self.metadata = dict(metadata)
        self.reference = reference
        self.base_lineage = reference.lineage  # what the engine must serve for it to apply
        self.options = dict(options)
        self._order = [n for n, _ in specs]
        self._dtypes = {n: t.dtype for n, t in specs}
        self._shapes = {n: tuple(t.shape) for n, t in specs}
        self._next = 0
        self._changes: dict[str, Change] = {}
        self._state = "open"
        self.fingerprints: dict[str, int] = {}  # of the changed tensors, once tensors() ran
        self.changed = 0  # elements that changed, over every tensor diffed (one without a
        self.numel = 0  # reference counts whole), of all their elements

    def write(self, name: str, tensor: torch.Tensor, cast: bool = False) -> None:
        if self._state != "open":
            raise RuntimeError(f"{self.path}: the delta is {self._state}")
        expected = self._order[self._next] if self._next < len(self._order) else None
        problem = None
        if name != expected:
            problem = f"{name!r} out of order ({expected!r} comes first)"
        elif tuple(tensor.shape) != self._shapes[name]:
            problem = f"{name!r} is {tuple(tensor.shape)}, the header says {self._shapes[name]}"
        if problem is not None:
            self.abort()
            raise RuntimeError(f"{self.path}: {problem}")
        try:
            change = self._changes[name] = self._diff(name, tensor)
        except BaseException:
            self.abort()
            raise
        self.changed += change.changed
        self.numel += change.numel
        self._next += 1

    def _diff(self, name: str, tensor: torch.Tensor) -> Change:
        dtype = self._dtypes[name]
        sparse = self.patchable is None or name in self.patchable
        change = self.reference.diff(name, tensor, dtype, sparse)
        if change is None:  # no reference for it (new, or another shape or dtype): whole
            held = self.reference.store(name, tensor, dtype)
            fingerprint = self.reference.fingerprint(name) or 0
            change = Change(held.numel(), held.numel(), fingerprint, dense=held)
        return change

    def tensors(self) -> tuple[list[tuple[str, torch.Tensor]], dict[str, str]]:
        """The file's tensors in order, and its metadata."""
        tensors: list[tuple[str, torch.Tensor]] = []
        prints: dict[str, int] = {}
        shapes: dict[str, list[int]] = {}
        for name, change in self._changes.items():
            if change.dense is not None:
                tensors.append((name, change.dense))
            elif change.sparse is not None:
                tensors += [(part_name(name, p), t) for p, t in change.sparse.items()]
                shapes[name] = list(self._shapes[name])
            else:
                continue  # unchanged: not in the file
            prints[name] = change.fingerprint
        base, version = self.metadata[BASE_VERSION_KEY], self.metadata.get(VERSION_KEY)
        self.fingerprints = prints
        meta = {**self.metadata, **delta_metadata(base, version, prints, shapes)}
        if self.base_lineage is not None:
            meta[BASE_LINEAGE_KEY] = self.base_lineage
        return tensors, meta

    def finish(self) -> SavedCheckpoint:
        if self._state != "open":
            raise RuntimeError(f"{self.path}: the delta is {self._state}")
        if self._next < len(self._order):
            self.abort()
            raise RuntimeError(f"{self.path}: {self._order[self._next]!r} was never written")
        try:
            tensors, meta = self.tensors()
            specs = [(n, torch.empty(t.shape, dtype=t.dtype, device="meta")) for n, t in tensors]
            with CheckpointWriter(self.path, specs, meta, **self.options) as writer:
                for name, t in tensors:
                    writer.write(name, t)
                saved = writer.finish()
        except BaseException:
            self.abort()
            raise
        self._state = "finished"
        self._changes.clear()
        if self.base_lineage is not None:
            self.reference.lineage = lineage_of(self.base_lineage, self.fingerprints)
        return saved

    def abort(self) -> None:
        """No file (none was started before :meth:`finish`); the reference, partly updated,
        is not trusted."""
        if self._state == "open":
            self._state = "aborted"
            self._changes.clear()
            self.reference.invalidate()
