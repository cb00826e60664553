"""The one way to write: a session that validates, plans, writes through views, and proves.

:func:`direct_reload_session` is the write path every public function takes
(:func:`direct_reload` is it with a default loader)::

    with direct_reload_session(model, weights) as reload:
        model.load_weights(reload.weights)      # any loader: the parameters carry checkpoint layout

Before the block runs, the whole checkpoint is validated against the layout recorded at load
and every name is resolved and proven; a refusal raises :class:`DirectReloadError` with nothing
written. Inside it, the model's parameters are re-pointed at views, in checkpoint layout, of
the storages they live in now. Leaving it normally restores the views and then, in order:
re-processes the modules handed to the engine, audits addresses, checks that every planned
target was written (a complete reload), reads every write back, and refreshes derived state.
Only then is the model declared whole.

From the first byte written until all of that has finished, the model is *undefined*: a
failure anywhere in between (or leaving the block by an exception, which then propagates
untouched) leaves it flagged, with the reason, until a complete reload succeeds.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from typing_extensions import TypedDict, Unpack

from .derived import refresh_derived_state
from .errors import DirectReloadError
from .extension import Reprocessor
from .parallel import helper_threads
from .plan import ReloadPlan, plan_direct_reload
from .proof import module_of
from .readback import ReadBack
from .record import require_layout
from .report import ReloadReport
from .snapshot import addresses, addresses_of, named_tensors
from .state import bridge_state, note_written
from .undo import HostStore, UndoLog
from .validate import learned_copies, validate_checkpoint
from .write_map import WriteMapLearner

WRITING = "a direct reload started writing and did not finish"
Weights = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@dataclass
class OpenReload:
    """What :func:`direct_reload_session` yields: the plan, the checkpoint to load (pass
    ``weights`` to the loader: the read-back names each write by it), and, once the block
    finished, the report."""

    plan: ReloadPlan
    weights: Iterator[tuple[str, torch.Tensor]]
    report: ReloadReport | None = None


class _Session:
    """One open write: the views swapped in, and everything needed to finish or abort it."""

    def __init__(
        self,
        model: torch.nn.Module,
        plan: ReloadPlan,
        readback: ReadBack,
        reprocessor: Reprocessor | None,
        partial: bool,
        now: dict[str, tuple],
    ):
        self.model = model
        self.plan = plan
        self.readback = readback
        self.reprocessor = reprocessor
        self.partial = partial
        self.state = bridge_state(model)
        self.was_undefined = self.state.undefined
        self.addresses = now  # the audit compares the addresses after the write with these
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.started = time.perf_counter()

    def open(self, live: Mapping[str, torch.Tensor]) -> None:
        """Point every directly written parameter (``live``: the model's tensors by name) at
        its target; the model is undefined."""
        self.state.writing = True
        self.state.undefined = self.was_undefined or WRITING
        with torch._C.DisableTorchFunctionSubclass():  # see snapshot.addresses_of
            for name, target in self.plan.targets.items():
                tensor = live[name]
                if id(tensor) not in self.saved:
                    self.saved[id(tensor)] = (tensor, tensor.data)
                    tensor.data = target.view
        if self.reprocessor is not None and self.plan.reprocess:
            self.reprocessor.begin(sorted(self.plan.reprocess))

    def _restore(self) -> None:
        with torch._C.DisableTorchFunctionSubclass():
            for tensor, original in self.saved.values():
                tensor.data = original
        self.state.writing = False
        note_written(self.model)

    def abort(self, reason: str) -> None:
        """Restore the live views and leave the model undefined."""
        self._restore()
        self.state.undefined = reason

    def _fail(self, reason: str, message: str, problems: Mapping[str, str]) -> DirectReloadError:
        self.state.undefined = reason
        return DirectReloadError(message, problems)

    def finish(self) -> ReloadReport:
        """Re-process, audit, check coverage, read back, refresh; the model is whole again."""
        try:
            if self.reprocessor is not None and self.plan.reprocess:
                self.reprocessor.finish()
        finally:
            self._restore()
        report = ReloadReport(reprocessed=dict(self.plan.reprocess), threads=helper_threads() + 1)
        report.write_s = time.perf_counter() - self.started
        moved = _moved(self.addresses, addresses(self.model))
        if moved:
            raise self._fail(
                "a reload changed parameter addresses",
                "audit failed: the reload moved storages",
                moved,
            )
        targets = self._written_targets()
        report.direct = len(targets)
        report.relocations = [t.relocation for t in targets.values() if t.relocation is not None]
        started = time.perf_counter()
        bad = self.readback.verify()
        report.verified_writes = len(self.readback.writes)
        report.readback_s = time.perf_counter() - started
        if bad:
            raise self._fail(
                "read-back after the push differs from the checkpoint",
                "read-back failed: the engine does not hold the checkpoint",
                bad,
            )
        started = time.perf_counter()
        written = {module_of(name)[0] for name in targets}
        refresh = {m: kind for m, kind in self.plan.refresh.items() if m in written}
        report.refreshed = refresh_derived_state(self.model, refresh)
        report.refresh_s = time.perf_counter() - started
        report.recovered_from_undefined = self.was_undefined
        self.state.undefined = None
        return report

    def _written_targets(self) -> dict:
        """The targets written: all of them for a complete reload (refused otherwise, naming
        the ones the load left out), those the load wrote into for a partial one."""
        if self.partial:
            spans = self.plan.spans
            return {n: t for n, t in self.plan.targets.items() if self.readback.wrote(spans[n])}
        missing = {
            name: "planned but not written by the load (the checkpoint lacks it, or the loader "
            "skipped it)"
            for name in unwritten_targets(self.model, self.plan, self.readback)
        }
        if missing:
            raise self._fail(
                "a complete reload left planned targets unwritten",
                "incomplete reload: the load did not write every weight",
                missing,
            )
        return self.plan.targets


def unwritten_targets(model: torch.nn.Module, plan: ReloadPlan, readback: ReadBack) -> list[str]:
    """The planned targets a complete reload must write (those the layout requires, with any
    bytes) into which ``readback`` noted no write: what a loader skipped."""
    layout = require_layout(model)
    spans = plan.spans
    return [
        name
        for name, t in plan.targets.items()
        if t.view.numel() and layout.must_write(name) and not readback.wrote(spans[name])
    ]


def _moved(before: Mapping[str, tuple], after: Mapping[str, tuple]) -> dict[str, str]:
    return {
        name: f"address/layout changed during reload: {was} -> {after.get(name)}"
        for name, was in before.items()
        if after.get(name) != was
    }


class PreparedReload:
    """A checkpoint validated and planned against a model, nothing written yet: what
    :func:`prepare_direct_reload` returns. :meth:`write` opens the session that writes it.

    Keeping the two apart lets a caller (an engine with several tensor-parallel ranks) agree
    that every rank can write before any rank does.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        items: list[tuple[str, torch.Tensor]],
        plan: ReloadPlan,
        now: dict[str, tuple],
        readback: str,
        reprocessor: Reprocessor | None,
        partial: bool,
        preflight_s: float,
        pre_images: bool | HostStore = False,
        stream: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None,
    ):
        self.model, self.items, self.plan, self.addresses = model, items, plan, now
        # what the loader is handed: the items, or tensors produced one at a time (no lambda
        # over self: the cycle kept the items, and the files they map, until a collection)
        self.stream, self.streamed = stream, stream is not None
        self.readback, self.reprocessor, self.partial = readback, reprocessor, partial
        self.preflight_s = preflight_s
        # without pre_images, what it wrote is taken back from the files served before (a
        # complete write's pre-images are a second copy of the weights: kept only when asked)
        self.pre_images = pre_images
        self.undo_log: UndoLog | None = None

    @property
    def mode(self) -> str:
        """``auto`` where modules are handed to the engine's re-processing, else ``direct``."""
        return "auto" if self.plan.reprocess else "direct"

    @contextlib.contextmanager
    def write(self) -> Iterator[OpenReload]:
        """``with prepared.write() as reload: loader(reload.weights)`` (see the module
        docstring for what happens when the block is left)."""
        started = time.perf_counter()
        state = bridge_state(self.model)
        if state.writing:
            raise DirectReloadError("a direct reload is already in progress on this model")
        live = named_tensors(self.model)
        if addresses_of(live) != self.addresses:
            raise DirectReloadError(
                "the model's storages changed since this reload was prepared (nothing was "
                "written): prepare it again"
            )
        # a complete write shows where every element goes; a push from memory (no delta
        # follows one) keeps the map already learned on these storages
        known = state.write_map is not None and state.write_map.addresses == self.addresses
        learn = not self.partial and not (self.streamed and known)
        learner = WriteMapLearner(self.plan.spans, self.addresses) if learn else None
        readback = ReadBack(
            set(self.plan.storages), self.readback, learner.note if learner else None
        )
        session = _Session(
            self.model, self.plan, readback, self.reprocessor, self.partial, self.addresses
        )
        session.open(live)
        weights = self.stream() if self.stream is not None else iter(self.items)
        handle = OpenReload(self.plan, readback.track(weights))
        try:
            with readback:
                yield handle
        except BaseException as exc:
            session.abort(
                f"direct reload failed after writing started: {type(exc).__name__}: {exc}"
            )
            raise
        try:
            report = session.finish()
            if learner is not None:  # a complete write shows where every element goes
                state.write_map = learner.finish(readback.other_writes)
        except DirectReloadError:
            raise  # the session named why the model is undefined
        except BaseException as exc:  # bits written: never taken for the old ones, with a reason
            state.undefined = f"{WRITING}: {type(exc).__name__}: {exc}"
            raise
        report.tensors = len(self.items)
        report.bytes = sum(t.numel() * t.element_size() for _, t in self.items)
        report.preflight_s = self.preflight_s
        report.elapsed_s = self.preflight_s + time.perf_counter() - started
        handle.report = report

    def run(
        self, load: Callable[[Iterable[tuple[str, torch.Tensor]]], object] | None = None
    ) -> ReloadReport:
        """:meth:`write` with ``load`` as the loader (default: the model's own
        ``load_weights`` if it has one, else a copy by name); the report. A failure after
        writing started raises :class:`DirectReloadError` (an interrupt such as
        ``KeyboardInterrupt`` propagates as itself), the model left undefined."""
        kept, before = None, bridge_state(self.model).undefined
        try:
            if self.pre_images:  # every target's bits, before the first byte is written
                views = [t.view for t in self.plan.targets.values()]
                store = self.pre_images if isinstance(self.pre_images, HostStore) else HostStore()
                kept = store.undo_log(self.model, views, self.plan.refresh)
            with self.write() as reload:
                if load is None:
                    own = getattr(self.model, "load_weights", None)
                    load = own if callable(own) else _copy_by_name(self.plan)
                load(reload.weights)
        except Exception as exc:
            undefined = bridge_state(self.model).undefined
            error = exc if isinstance(exc, DirectReloadError) else None
            error = error or DirectReloadError(undefined or f"{type(exc).__name__}: {exc}")
            if kept is not None and undefined is not None:
                raise kept.restore_after(self.model, error, before) from exc
            if error is exc:
                raise
            raise error from exc
        assert reload.report is not None
        self.undo_log = kept
        return reload.report


def prepare_direct_reload(
    model: torch.nn.Module,
    weights: Weights,
    *,
    check_finite: bool = True,
    reprocessor: Reprocessor | None = None,
    reprocessable: set[str] | frozenset[str] = frozenset(),
    readback: str = "sampled",
    partial: bool = False,
    pre_images: bool | HostStore = False,
    stream: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None,
) -> PreparedReload:
    """Validate ``weights`` (the whole checkpoint) and plan their write; nothing is written.

    Names, shapes and dtypes are checked against the recorded layout (and NaN/Inf when
    ``check_finite``), and every name is resolved and proven; a refusal raises
    :class:`DirectReloadError` naming each tensor. ``reprocessor`` handles the modules of
    ``reprocessable`` that cannot be written directly; ``readback`` is ``"sampled"``,
    ``"full"`` or ``"off"``. ``partial`` weights (a subset, applied on top of what the model
    holds) may leave names out; only the modules they write into are refreshed, and a partial
    reload that would need re-processing by the engine is refused. A complete reload must
    write every planned target. ``pre_images``: keep a copy of every target before writing
    (the writer's undo log; a failed write restores it), for weights no file can give back;
    a :class:`~.undo.HostStore`: take it from the store (no copy where it is up to date).
    ``stream``: the tensors, one at a time as the loader asks, where ``weights`` only describe
    them (:class:`~weight_bridge.checkpoint.live.LiveTensor`: validated from metadata and parts).
    """
    started = time.perf_counter()
    state = bridge_state(model)
    items = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
    now = addresses(model)  # what this rank writes of each tensor pushed from memory, if known:
    written = learned_copies(state.write_map, now)  # the check reads that part (validate.py)
    validate_checkpoint(require_layout(model), items, check_finite, partial, written)
    plan = plan_direct_reload(model, reprocessable if reprocessor is not None else frozenset(), now)
    if plan.problems:
        still = f"; the model is still undefined: {state.undefined}" if state.undefined else ""
        raise DirectReloadError(
            f"not directly reloadable (nothing was written){still}", plan.problems
        )
    if (partial or pre_images) and plan.reprocess:  # pre-images cannot undo a re-processing
        what = "a partial checkpoint" if partial else "weights pushed from memory"
        raise DirectReloadError(
            f"{what} cannot be re-processed by the engine, which needs whole modules and no "
            "copy of them: push a complete checkpoint file (nothing was written)",
            {module: f"needs re-processing: {why}" for module, why in plan.reprocess.items()},
        )
    preflight_s = time.perf_counter() - started
    return PreparedReload(
        model, items, plan, now, readback, reprocessor, partial, preflight_s, pre_images, stream
    )


class ReloadOptions(TypedDict, total=False):
    """The keyword arguments of :func:`prepare_direct_reload`, shared by the calls built on it."""

    check_finite: bool
    reprocessor: Reprocessor | None
    reprocessable: set[str] | frozenset[str]
    readback: str
    partial: bool


def direct_reload_session(
    model: torch.nn.Module, weights: Weights, **options: Unpack[ReloadOptions]
) -> contextlib.AbstractContextManager[OpenReload]:
    """``with direct_reload_session(model, weights) as reload: loader(reload.weights)``:
    :func:`prepare_direct_reload` (same arguments; a refusal raises here, nothing written),
    then :meth:`PreparedReload.write`."""
    return prepare_direct_reload(model, weights, **options).write()


def direct_reload(
    model: torch.nn.Module,
    weights: Weights,
    load: Callable[[Iterable[tuple[str, torch.Tensor]]], object] | None = None,
    **options: Unpack[ReloadOptions],
) -> ReloadReport:
    """Write ``weights`` into ``model``'s live storages: :func:`prepare_direct_reload` (same
    keyword arguments), then :meth:`PreparedReload.run` with ``load``."""
    return prepare_direct_reload(model, weights, **options).run(load)


def _copy_by_name(plan: ReloadPlan) -> Callable[[Iterable[tuple[str, torch.Tensor]]], None]:
    def load(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in weights:
            plan.targets[name].view.copy_(t)

    return load
