"""The undo log of a delta: the pre-images of every element it wrote.

Why: a delta is applied in place, element by element; reading what each element held before
the first write makes undoing it O(delta) and exact, with no file to re-read (a failed delta,
or a committed one another rank's failure rolls back). It is held until the next update, so it
is kept as small as the delta that made it: a scattered write's positions in the delta file's
own encoding (2 bytes each, sorted, in blocks of 65536), a dense tensor's none at all (a view of
live storage, by the segment's geometry), so a log holds about the bytes of the delta it undoes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from .derived import refresh_derived_state
from .errors import DirectReloadError
from .positions import Positions
from .state import bridge_state, note_written


def host_copy(view: torch.Tensor) -> torch.Tensor:
    """A copy of ``view`` in host memory (pinned where the view is on a CUDA device, so the copy
    back is a DMA): the store of a rollback that has no file to re-read. Why host memory: an
    engine at 90 % of its accelerator's memory has no room for a second copy of its weights,
    and the copy goes straight from the view into the host tensor, through no buffer on the
    device. On a CPU engine, host and device are the same memory."""
    pinned = view.device.type == "cuda"
    copy = torch.empty(view.shape, dtype=view.dtype, device="cpu", pin_memory=pinned)
    return copy.copy_(view)


@dataclass
class UndoLog:
    """The pre-images of every element a delta wrote, in write order: restoring them in
    reverse gives back the previous bits exactly, with no file. Each entry is a storage, the
    positions written (None: the storage is a view written whole) and their pre-images.
    ``modules``: whose derived state to refresh afterwards; ``fingerprints``: the served
    fingerprints before."""

    entries: list[tuple[torch.Tensor, Positions | None, torch.Tensor]] = field(default_factory=list)
    modules: dict[str, str] = field(default_factory=dict)
    fingerprints: dict[str, int] = field(default_factory=dict)

    @classmethod
    def joined(cls, logs: list[UndoLog | None]) -> UndoLog | None:
        """The logs of writers that ran in this order as one log (None if any has none): the
        entries in write order, every module to refresh, the fingerprints from before the
        first."""
        if not logs or any(log is None for log in logs):
            return None
        if len(logs) == 1:
            return logs[0]
        whole = cls()
        for log in reversed(logs):  # the earliest writer's fingerprints win
            assert log is not None
            whole.entries[:0] = log.entries
            whole.modules.update(log.modules)
            whole.fingerprints.update(log.fingerprints)
        return whole

    @classmethod
    def pre_images(
        cls, model: torch.nn.Module, views: Iterable[torch.Tensor], refresh: Mapping[str, str]
    ) -> UndoLog:
        """A copy of each of ``views`` (live storage, before a write that has no file to give
        it back: tensors pushed from memory) in host memory (:func:`host_copy`: nothing on the
        engine's device), each distinct view once, the served fingerprints, and ``refresh``:
        whose derived state to re-derive after restoring."""
        return HostStore().undo_log(model, views, refresh)  # a store of its own, filled now

    def restore_after(
        self, model: torch.nn.Module, error: DirectReloadError, before: str | None
    ) -> DirectReloadError:
        """After a write that failed with the model undefined: the pre-images back and the
        model as it was (``before``: why it was undefined then, None: defined; if restoring
        fails too, undefined naming both); the error to raise, saying which."""
        state = bridge_state(model)
        why = state.undefined
        try:
            self.undo(model)
        except Exception as failed:
            state.undefined = f"{why}; restoring the pre-images failed too: {failed}"
            return DirectReloadError(f"{error.summary}; {state.undefined}", error.problems)
        state.undefined = before
        return DirectReloadError(
            f"{error.summary}; the previous weights were restored from their pre-images",
            error.problems,
        )

    @property
    def nbytes(self) -> int:
        """What the log holds: positions and pre-images."""
        return sum((w.nbytes if w is not None else 0) + p.nbytes for _, w, p in self.entries)

    def log(self, storage: torch.Tensor, where: Positions | None, pre: torch.Tensor) -> None:
        """Log the pre-images ``pre`` of ``storage`` at ``where`` (the scatter's own positions,
        shared, not copied; None: of all of the view ``storage``)."""
        self.entries.append((storage, where, pre))

    def undo(self, model: torch.nn.Module) -> None:
        """Restore every pre-image (newest first), re-derive, and put the fingerprints back.
        A write like any other: copies of the weights dated before are out of date."""
        try:
            for storage, where, pre in reversed(self.entries):
                if where is None:
                    storage.copy_(pre)
                    continue
                for start, end, at in where.chunks(storage.device):
                    storage[at] = pre[start:end]
        finally:
            note_written(model)
        state = bridge_state(model)
        refresh_derived_state(model, self.modules)
        state.fingerprints.update(self.fingerprints)


def _key(view: torch.Tensor) -> tuple:
    return (view.data_ptr(), tuple(view.shape), tuple(view.stride()), view.dtype)


class HostStore:
    """The bits every view a push from memory writes held last, in host memory: the rollback
    source of updates that have no file to re-read (an engine in the trainer's ranks).

    Why not pre-images taken as each push writes: that is a copy of the weights on the push's
    critical path (on an accelerator also a second copy on the device, or a transfer out of it
    before the first byte is written). The store is instead brought up to date after an update
    landed, off the critical path (:meth:`landed`: a thread, on CUDA a side stream into pinned
    memory), and an update's pre-images are its tensors, not copied (:meth:`undo_log`). It is
    one copy of what this worker's pushes write, allocated once, in host memory (plentiful
    where the device is full); nothing on the engine's device.

    Whether a copy still holds what the engine holds is derived, never told: each copy is
    dated with the model's write count when it was taken (``BridgeState.writes``, moved at
    the end of every write by whatever wrote: :func:`~.state.note_written`), and a push takes
    a copy as its pre-images only where that date is still the model's; any other copy is
    taken again first. So a writer that never uses the store (a file push, vLLM's layerwise
    reload, a rollback) makes it out of date by writing, with nothing to remember.
    """

    def __init__(self) -> None:
        self.copies: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # key: (live, host)
        self.dated: dict[tuple, int] = {}  # key -> the model's write count its copy was taken at
        self.writing: set[tuple] = set()  # the keys the last undo log was taken for
        self._refreshing: threading.Thread | None = None
        self.refresh_s = 0.0  # what the last copy in the background took

    @property
    def nbytes(self) -> int:
        return sum(host.nbytes for _, host in self.copies.values())

    def current(self, model: torch.nn.Module) -> set[tuple]:
        """The keys whose copy holds what ``model`` holds now (dated at its write count)."""
        self.wait()
        now = bridge_state(model).writes
        return {key for key, date in self.dated.items() if date == now}

    def undo_log(
        self, model: torch.nn.Module, views: Iterable[torch.Tensor], refresh: Mapping[str, str]
    ) -> UndoLog:
        """The pre-images of ``views`` before a write (:meth:`UndoLog.pre_images`'s log): the
        store's own tensors where they hold the live bits (dated at the model's write count),
        else copied into it now (the first push, or after any other write)."""
        self.wait()
        state = bridge_state(model)
        log = UndoLog(modules=dict(refresh), fingerprints=dict(state.fingerprints))
        self.writing = set()
        for view in views:  # a tied weight's targets are one view: stored once
            key = _key(view)
            if key in self.writing:
                continue
            self.writing.add(key)
            kept = self.copies.get(key)
            if kept is None:
                self.copies[key] = kept = (view, host_copy(view))
            elif self.dated.get(key) != state.writes:
                kept[1].copy_(view)
            self.dated[key] = state.writes
            log.log(view, None, kept[1])
        return log

    def landed(self, model: torch.nn.Module) -> None:
        """The update the last undo log was taken for landed on every rank (no rollback needs
        its old bits now): copy the new bits in, in the background (:meth:`wait` joins it),
        dated at the model's write count now (a write that overlaps the copy moves the count:
        the copy is then out of date, never taken for current)."""
        self.wait()
        keys, self.writing = self.writing, set()
        pairs = [self.copies[k] for k in keys]
        if not pairs:
            return
        for key in keys:  # out of date until the copy is done
            self.dated.pop(key, None)
        date = bridge_state(model).writes
        event = None
        if pairs[0][0].device.type == "cuda":  # after the writes queued on the current stream
            event = torch.cuda.current_stream(pairs[0][0].device).record_event()

        def copy() -> None:
            started = time.perf_counter()
            try:
                _copy_back(pairs, event)
            except Exception:  # left undated: the next push copies them first
                return
            self.dated.update(dict.fromkeys(keys, date))
            self.refresh_s = time.perf_counter() - started

        self._refreshing = threading.Thread(target=copy, name="weight-bridge-store", daemon=True)
        self._refreshing.start()

    def wait(self) -> None:
        """Until a copy in the background finished."""
        thread, self._refreshing = self._refreshing, None
        if thread is not None:
            thread.join()


def _raw(t: torch.Tensor) -> np.ndarray:
    """``t``'s bytes as numpy sees them (as integers of its width: numpy has no bfloat16)."""
    return t.detach().view(_INTS[t.element_size()]).numpy()


_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@torch.no_grad()
def _copy_back(pairs: list[tuple[torch.Tensor, torch.Tensor]], event: object) -> None:
    if event is None:  # on the CPU: numpy's copy, on this thread alone (torch's would start an
        for view, host in pairs:  # OpenMP team of its own beside the engine's bound threads)
            np.copyto(_raw(host), _raw(view))
        return
    stream = torch.cuda.Stream(pairs[0][0].device)
    stream.wait_event(event)  # type: ignore[arg-type]
    with torch.cuda.stream(stream):
        for view, host in pairs:
            host.copy_(view, non_blocking=True)
    stream.synchronize()
