"""The one protocol every writer of an update follows, and how writers compose into one write.

A push may take more than one writer: a delta scatters what its write map can patch and hands
what it cannot (a tensor its loader transforms, one sent in another dtype) to a direct reload
through the loader. Each writer writes its own way, but every one answers the same three
questions, so whatever composes them (:class:`Writers`; the engine worker's transaction,
:mod:`weight_bridge.vllm.worker.transaction`, which rolls a push back) treats them alike:

* ``mode``: what the push's report calls it;
* ``run()``: write, once. It returns its report, or raises :class:`DirectReloadError` having left
  the model either on its previous bits (it wrote nothing, or undid what it wrote) or marked
  *undefined* (:mod:`.state`), never in between;
* ``undo_log``: once ``run`` returned, the pre-images that take back exactly what it wrote, in
  O(what it wrote) (:class:`~.undo.UndoLog`), or None: what it wrote is taken back by re-reading
  the files served before, each by identity (a complete write, whose pre-images would be a
  second copy of the model).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from .errors import DirectReloadError
from .report import ReloadReport
from .state import bridge_state
from .undo import UndoLog


class Writer(Protocol):
    """A prepared write: everything checked, nothing written (see the module docstring)."""

    @property
    def mode(self) -> str: ...

    undo_log: UndoLog | None

    def run(self) -> ReloadReport: ...


class Writers:
    """Several writers run as one: in order, their reports added up. If one fails and the
    model is still defined (the failed one wrote nothing or undid itself), every writer that
    ran before it is undone, newest first, from its undo log; one that has none leaves the
    model undefined, for the caller to re-write from its files. The undo log of the whole is
    the writers' logs joined, or None as soon as one of them has none."""

    def __init__(self, model: torch.nn.Module, parts: Sequence[Writer]):
        if not parts:
            raise ValueError("Writers needs at least one writer")
        self.model, self.parts = model, list(parts)
        self.mode = self.parts[0].mode
        self.undo_log: UndoLog | None = None

    def run(self) -> ReloadReport:
        report = ReloadReport()
        ran: list[Writer] = []
        for writer in self.parts:
            try:
                part = writer.run()
            except BaseException as exc:
                how = self._undo(ran)
                if isinstance(exc, DirectReloadError) and how:
                    raise DirectReloadError(f"{exc.summary}; {how}", exc.problems) from exc
                raise
            ran.append(writer)
            report.add(part)
        self.undo_log = UndoLog.joined([w.undo_log for w in ran])
        return report

    def _undo(self, ran: list[Writer]) -> str:
        """Undo ``ran`` after a later writer failed; what that did, for the error ('': the
        failed writer's own message says it)."""
        state = bridge_state(self.model)
        if not ran or state.undefined is not None:
            return ""  # nothing ran before, or the failed writer left the model undefined
        logs = [w.undo_log for w in ran]
        missing = [w.mode for w, log in zip(ran, logs, strict=True) if log is None]
        if missing:
            state.undefined = (
                f"a later writer of the update failed after {', '.join(missing)} wrote without "
                "pre-images"
            )
            return f"the weights are undefined: {state.undefined}"
        try:
            for log in reversed(logs):
                log.undo(self.model)  # type: ignore[union-attr]
        except Exception as failed:
            state.undefined = f"undoing the writers that ran failed: {failed}"
            return f"the weights are undefined: {state.undefined}"
        return "every writer that ran was undone from its pre-images"
