"""One worker's side of an update: a transaction with a served chain to roll back to.

Each worker (each tensor-parallel rank) reads the checkpoint itself, memory-mapped, and its own
weight loaders keep only its shard. An update runs in phases, so that the engine core
(:mod:`weight_bridge.vllm.core.updates`) can make every rank agree before any rank writes, and
roll back every rank that wrote if one failed:

1. ``PREPARE`` (:meth:`PushTransaction.prepare`): the path against the checkpoint root
   (:mod:`weight_bridge.checkpoint.trust`), every header field the write or its bookkeeping
   reads (and, if asked, the content hash), a partial's base version, the whole checkpoint
   against the layout recorded at load (names, shapes, dtypes, NaN/Inf), every weight resolved
   and proven. Nothing is written; a refusal is a result naming each tensor.
2. ``COMMIT`` (:meth:`PushTransaction.commit`): the one writer prepared for it
   (:mod:`.writers`, by mode: every writer follows :class:`~weight_bridge.direct.writer.Writer`)
   writes, reads back and refreshes derived state. A failure past the first write is a result
   too: the writer left the model on its previous bits or marked undefined.
3. ``ROLL_BACK`` (:meth:`PushTransaction.roll_back`): take back what the writer wrote: from its
   undo log (a delta's pre-images; for a push from memory, the host store:
   :class:`~weight_bridge.direct.undo.HostStore`), or by re-writing the version served before,
   re-read through the descriptors held since each file was pushed, identities checked first
   (:mod:`~weight_bridge.vllm.worker.served_chain`). If that fails too, it stays *undefined*.

Every file of the chain is held shared-locked, so no writer recycles it, until the update
that replaced it ends (vLLM's ``finish_weight_update``: :meth:`PushTransaction.settle`).

Nothing here raises, for any outcome: :meth:`PushTransaction.run` is the one entry of every
phase (:class:`~weight_bridge.vllm.outcome.Phase`), and whatever a phase raises, typed or not (a
parser's ``ValueError``, a ``MemoryError``, a failed allocation on the device), becomes that
phase's outcome in its :class:`PushResult`: in ``PREPARE`` a refusal with nothing written; in
``COMMIT`` a failure after writing started, to be rolled back (a writer that raised its typed
error left the model on its previous bits or undefined, as the writer protocol says; one that
raised anything else is taken as having written, and the model is marked undefined until the
rollback restores it; one that returned left new bits, defined, which the rollback takes back);
in ``ROLL_BACK`` the model undefined, naming the cause. So every rank answers every phase: no
rank's engine core waits for one that raised (:mod:`~weight_bridge.vllm.core.updates`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from typing import Any

import torch

from ...checkpoint import BASE_VERSION_KEY, CheckpointError, CheckpointReader
from ...checkpoint.live import LiveCheckpoint
from ...checkpoint.read import CheckpointSource
from ...checkpoint.trust import trusted_checkpoint
from ...delta.format import BASE_LINEAGE_KEY, header_fingerprints, is_delta
from ...direct import DirectReloadError, ReloadReport
from ...direct.errors import BaseVersionError
from ...direct.state import mark_undefined, note_written, undefined_reason
from ...direct.undo import HostStore
from ...direct.writer import Writer
from ..internals import lora
from ..options import BridgeOptions
from ..outcome import Phase, PushFailure, PushResult
from .adapter_writer import MODE as ADAPTER
from .adapter_writer import AdapterWrite
from .delta_links import link_fingerprints, link_lineage, served_dtypes
from .served_chain import ServedCheckpoint, check_lineage, compact, hold
from .update_request import PreparedUpdate, UpdateRequest
from .writers import WriteJob, prepare_writer


class PushTransaction:
    """The update transaction of one worker's model, and the chain of checkpoints it serves."""

    def __init__(
        self, model: torch.nn.Module, model_config: Any, options: BridgeOptions, rank: int
    ):
        self.model = model
        self.model_config = model_config
        self.options = options
        self.rank = rank
        self.result = PushResult(rank=rank)
        self._pending: PreparedUpdate | None = None
        start = str(getattr(model_config, "model", "") or "")
        # what the served version is made of: a complete checkpoint, then partials on top of it
        self.served: list[ServedCheckpoint] = (
            [hold(os.path.abspath(start))] if os.path.isdir(start) else []
        )
        self._started_on = list(self.served)
        # the chain served before the last commit, kept until no rank needs to roll back to it
        self._before: list[ServedCheckpoint] | None = None
        self._undone = False  # the last commit failed and its writer restored the bits
        self._pre_images: ServedCheckpoint | None = None  # the link whose undo log to drop
        # a writer that returned before what followed it in COMMIT failed: what to take back
        self._unserved: Writer | None = None
        self._opened: CheckpointSource | None = None  # by a PREPARE running
        self._committing: PreparedUpdate | None = None  # the update COMMIT wrote (until it settles)
        self._reload: Any = None  # the worker's reload_weights, handed in by commit/roll_back
        # what pushes from memory roll back to (their tensors are not files to re-read)
        self.store = HostStore()

    def run(self, phase: Phase, *args: Any) -> PushResult:
        """Run ``phase`` (its method of the same name) and answer this rank's result, whatever
        it raised (the module docstring says what each phase's failure means). An interrupt
        (``KeyboardInterrupt``, ``SystemExit``) is not an outcome: it propagates."""
        step = getattr(self, phase.value)
        pending = self._pending if phase is Phase.COMMIT else None
        writes = phase in (Phase.COMMIT, Phase.ROLL_BACK)
        if writes:  # no copy into the store runs beside a writer or a rollback reading it
            self.store.wait()
        try:
            return step(*args)
        except Exception as exc:
            return self._failed(phase, exc)
        finally:
            if writes and self.result.written:  # whichever writer: copies dated before are stale
                note_written(self.model)
            if pending is not None and isinstance(pending.reader, LiveCheckpoint):
                # the other ranks may wait in its stream's next agreement: answer it (a
                # failure to is theirs to time out on; this rank's outcome is decided)
                with contextlib.suppress(Exception):
                    pending.reader.end_stream()

    def _failed(self, phase: Phase, exc: Exception) -> PushResult:
        result = self.result
        pending, self._pending = self._pending, None
        reader = pending.reader if pending is not None else self._opened
        self._opened = None
        committing = self._committing.reader if self._committing is not None else None
        for opened in (reader, committing):  # nothing held past it (its descriptor, lock, map)
            if opened is not None:
                opened.close()
        if phase is Phase.PREPARE:
            result.error = PushFailure.of(exc, "refused", reader)
        elif phase is Phase.COMMIT:
            self._failed_write(result, exc)
        elif phase is Phase.ROLL_BACK:
            why = f"rolling back failed: {type(exc).__name__}: {exc}"
            before = undefined_reason(self.model) or "an update failed"
            mark_undefined(self.model, f"{before}; {why}")
            result.rolled_back = why
        elif result.error is None and result.written:  # FAIL: the failure is recorded anyway
            result.error = PushFailure.of(exc, "after-write", reader)
        return self._finished(result)

    def _failed_write(self, result: PushResult, exc: Exception) -> None:
        """What a failed ``COMMIT`` left, for ``ROLL_BACK``: nothing, where the writer never
        started; the writer's protocol, where it raised its typed error; new bits to take
        back, where it returned (served or not); else bits nobody can vouch for (undefined)."""
        pending = self._committing
        result.written = True
        result.error = PushFailure.of(exc, "after-write", pending.reader if pending else None)
        if self._before is not None:
            return  # committed and served: ROLL_BACK re-serves the chain from before
        if pending is None or not pending.started:
            self._undone = True  # not a byte written
        elif pending.ran:
            self._unserved = pending.writer  # new bits, defined: ROLL_BACK takes them back
        elif isinstance(exc, (DirectReloadError, CheckpointError)):
            self._undone = undefined_reason(self.model) is None  # the writer restored itself
        elif undefined_reason(self.model) is None:
            why = f"the write raised {type(exc).__name__}: {exc}; what it wrote is not known"
            mark_undefined(self.model, why)

    # -- the phases, each a method named as its Phase ------------------------------------------

    def prepare(self, update_info: dict[str, Any] | UpdateRequest) -> PushResult:
        """Check everything about the request's checkpoint (every header field the write or
        its bookkeeping reads, each tensor materialised where the engine holds it); write
        nothing."""
        self.settle()
        self.result = PushResult(rank=self.rank)
        request = (
            update_info
            if isinstance(update_info, UpdateRequest)
            else UpdateRequest.from_dict(dict(update_info))
        )
        manager = lora.manager_of(self.model)
        if manager is not None:  # adapters stay across the update unless it writes the base
            lora.keep_adapters_once(manager)
        result, source = self.result, request.checkpoint
        result.checkpoint = source.path if isinstance(source, LiveCheckpoint) else source
        reader = self._opened = self._open(source)
        path = result.checkpoint = str(reader.path)
        verify = _choose(request.verify_hash, self.options.verify_hash)
        if verify and isinstance(reader, CheckpointReader):  # in memory: no file, no hash
            reader.verify_hash()
        metadata = reader.metadata
        base = metadata.get(BASE_VERSION_KEY)
        result.partial = base is not None
        result.delta = is_delta(metadata)
        result.version = metadata.get("version")
        prints = header_fingerprints(path, metadata)
        if base is not None:
            self._check_base(path, base, request.served_version)
            check_lineage(path, base, metadata.get(BASE_LINEAGE_KEY), self.served)
        items = list(reader.tensors())
        finite = _choose(request.check_finite, self.options.check_finite)
        stream = reader.stream if isinstance(reader, LiveCheckpoint) else None
        job = self._job(path, metadata, items, finite, result.partial, stream)
        writer = prepare_writer(job)
        result.mode = writer.mode
        if isinstance(writer, AdapterWrite):  # the engine core checks no request still uses it
            result.adapter = {"retiring": writer.retiring}
        below = self.served[-1].lineage if self.served else None
        lineage = link_lineage(prints, result.partial, below)
        self._pending = PreparedUpdate(
            reader, items, writer, path, result.partial, job.pre_images is not None, prints, lineage
        )
        self._opened = None
        return self._finished(result)

    def _open(self, checkpoint: str | LiveCheckpoint) -> CheckpointSource:
        """The checkpoint to prepare: tensors the trainer holds in this process
        (:mod:`weight_bridge.checkpoint.live`), each materialised on the engine's device, or a
        file under the checkpoint root, held from now (what is served is exactly this)."""
        if isinstance(checkpoint, LiveCheckpoint):
            checkpoint.open_on(_device_of(self.model))
            return checkpoint
        path = trusted_checkpoint(checkpoint, self.options.checkpoint_root)
        return CheckpointReader(path, hold=True)

    def _check_base(self, path: str, base: str, served: str | None) -> None:
        """A partial checkpoint applies on top of exactly its base version, or not at all."""
        undefined = undefined_reason(self.model)
        if undefined is not None:
            what = f"no version: its weights are undefined ({undefined})"
        elif served is None or not self.served:
            what = "an unknown version (nothing it can roll back to)"
        elif served != base:
            started = self.served == self._started_on
            what = f"version {served!r}" + (" (the weights it started with)" if started else "")
        else:
            return
        raise BaseVersionError(
            f"checkpoint {path} applies on top of version {base!r}, but the engine serves "
            f"{what}; push a complete checkpoint (nothing was written)"
        )

    def _job(
        self, path: str, metadata: dict, items: list, finite: bool, partial: bool, stream=None
    ) -> WriteJob:
        """What the writer is prepared from; ``stream``: the tensors of a push from memory."""
        # no file to re-read what it replaces: the writer keeps the pre-images (the host store)
        from_memory = stream is not None or any(link.in_memory for link in self.served)
        store = self.store if self.options.rollback and from_memory else None
        args = (path, metadata, items, finite, partial, self._vllm_reload, store, stream)
        return WriteJob(self.model, self.model_config, self.options, *args)

    def _vllm_reload(self, **kwargs: Any) -> None:
        """The worker's layerwise ``reload_weights``, for a writer that rides it; known only
        when a phase that writes is called (:func:`~.backend.call_backend` passes it)."""
        self._reload(**kwargs)

    def commit(self, reload_weights: Any, forget_outputs: Any) -> PushResult:
        """Write the prepared update (directly through the model's ``load_weights``, or with
        ``reload_weights``, the worker's vLLM layerwise reload, where that was planned), then
        ``forget_outputs()`` (the runner's caches of outputs the old weights computed);
        afterwards the engine serves it, or the result says what failed after writing
        started."""
        pending, result = self._pending, self.result
        if pending is None:
            return result  # refused in phase 1: nothing to write
        self._pending, self._committing = None, pending
        self._reload = reload_weights
        result.written = True  # from here on this worker's weights may have changed
        self._undone, self._unserved = False, None
        result.report = self._write(pending)
        if isinstance(pending.writer, AdapterWrite):  # the base chain is unchanged: the
            self._unserved = pending.writer  # writer's undo log takes it back until it settles
            result.adapter = pending.writer.landed()
        else:
            self._serve(pending)
        if not pending.partial and pending.writer.mode != ADAPTER:
            result.report.dtypes = served_dtypes(self.model)
        forget_outputs()
        pending.reader.close()
        return self._finished(result)

    def _write(self, pending: PreparedUpdate) -> ReloadReport:
        pending.started = True
        manager = lora.manager_of(self.model)
        if manager is not None and pending.writer.mode != ADAPTER:
            lora.base_written(manager)  # vLLM drops its adapters at the update's end
        report = pending.writer.run()
        pending.ran = True
        if pending.writer.mode == ADAPTER:
            return report  # no base weight written: the served fingerprints stand
        is_delta_link = is_delta(pending.reader.metadata)
        link_fingerprints(
            self.model, pending.fingerprints, is_delta_link, pending.items, pending.partial
        )
        return report

    def _serve(self, pending: PreparedUpdate) -> None:
        """Record the written checkpoint as (the last part of) what this worker serves, its
        files held since it was prepared; the chain it replaces is kept until the update ends,
        in case another rank failed. Links every tensor of which the new one holds too go."""
        undo = pending.writer.undo_log
        names = frozenset(n for n, _ in pending.items)
        reader, live = pending.reader, isinstance(pending.reader, LiveCheckpoint)
        held = reader.take_held() if isinstance(reader, CheckpointReader) else []
        link = ServedCheckpoint(pending.path, None, held, names, undo, pending.lineage, live)
        chain = [*self.served, link] if pending.partial else [link]
        served, _ = compact(chain)  # what is dropped stays held in _before until settle
        # nothing above can fail half-way through what follows: the chain changes at once
        self._before, self.served = list(self.served), served
        for older in self._before:  # a rollback of this update undoes the new link alone
            older.undo = None
        self._pre_images = link if pending.pre_images else None

    def settle(self) -> PushResult:
        """The update ended (or a new one starts): release every file the served chain no
        longer needs (the chain before the last commit, links compacted away)."""
        self.abandon()
        self._unserved = self._committing = None
        landed = self._before is not None and undefined_reason(self.model) is None
        if landed and self._pre_images is not None:  # the store catches up, off the next push
            self.store.landed(self.model)
        if self._pre_images is not None:  # what it replaced: no rollback needs it now
            self._pre_images.undo, self._pre_images = None, None
        live = {id(link) for link in self.served}
        for link in self._before or ():
            if id(link) not in live:
                link.release()
        self._before = None
        return self.result

    def roll_back(self, reload_weights: Any, version: str | None) -> PushResult:
        """After a failed update on any rank: re-write the version served before, if this
        worker's weights changed (a success here, or a failure past the first write)."""
        self.abandon()  # prepared here, committed nowhere
        result = self.result
        if not result.wrote:
            return result
        self._reload = reload_weights
        label = f"version {version!r}" if version is not None else "the version served before"
        if self._undone:
            result.rolled_back = f"the engine rolled back to {label}: the failed write restored it"
            return self._finished(result)
        if not self.options.rollback:
            mark_undefined(
                self.model,
                undefined_reason(self.model)
                or "an update failed on another rank after this one wrote it (rollback is off)",
            )
            return self._finished(result)
        undo = None
        if self._before is not None:  # this rank's commit succeeded: back to the old chain
            kept = {id(link) for link in self._before}
            dropped = [link for link in self.served if id(link) not in kept]
            self.served, self._before = self._before, None
            undo = dropped[0].undo if len(dropped) == 1 else None
            for link in dropped:
                link.release()
        elif self._unserved is not None:  # the write returned, what followed it failed
            undo, self._unserved = self._unserved.undo_log, None
        started = time.perf_counter()
        if undo is not None:  # the writer's pre-images, O(what it wrote), no file re-read
            undo.undo(self.model)
        else:
            self._rewrite(self.served)
        result.rollback_s = time.perf_counter() - started
        result.rolled_back = (
            f"the engine rolled back to {label} ({self.served[-1].path}) in "
            f"{result.rollback_s:.2f} s and serves it"
        )
        return self._finished(result)

    def _finished(self, result: PushResult) -> PushResult:
        result.undefined = undefined_reason(self.model)
        result.served = [link.path for link in self.served]
        return result

    def _rewrite(self, chain: list[ServedCheckpoint]) -> None:
        """Write ``chain`` (a complete checkpoint, then partial ones) as it was served."""
        if not chain:
            raise DirectReloadError("the engine holds no checkpoint of it to re-read")
        readers: list[CheckpointReader] = []
        try:
            for link in chain:  # every file opened as served, identity checked, before any write
                readers.append(link.reader())
            for i, (link, reader) in enumerate(zip(chain, readers, strict=True)):
                items = list(reader.tensors())
                job = self._job(link.path, reader.metadata, items, False, i > 0)
                # a partial link (pushed in the bridge's own mode) is re-written by the bridge's
                # writer: vLLM's direct reload takes complete checkpoints only
                mode = "direct" if i > 0 and self.options.reload_mode == "vllm-direct" else None
                writer = prepare_writer(job, mode)
                prints = header_fingerprints(link.path, reader.metadata)
                self._write(PreparedUpdate(reader, items, writer, link.path, i > 0, False, prints))
        finally:
            for reader in readers:
                reader.close()

    def fail(self, why: str, problems: dict | None = None) -> PushResult:
        """The update written here failed in a later step outside this worker (the engine
        core's cache reset, a delta's fingerprints summed over the ranks): a failure after
        writing, to be rolled back."""
        problems = dict(problems or {})
        self.result.error = PushFailure("DirectReloadError", why, problems, "after-write")
        return self._finished(self.result)

    def abandon(self) -> PushResult:
        """Drop a prepared update that will not be committed."""
        if self._pending is not None:
            self._pending.reader.close()
            self._pending = None
        return self.result


def _device_of(model: torch.nn.Module) -> torch.device:
    """Where the engine holds its weights (the device of its first tensor)."""
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    return first.device if first is not None else torch.device("cpu")


def _choose(asked: bool | None, default: bool) -> bool:
    return default if asked is None else bool(asked)
