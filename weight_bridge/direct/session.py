"""The write session of a direct reload, and the undefined mark that covers it.

From the first byte written until every write, re-processing, refresh of derived state and
read-back has finished, the model is *undefined*: a failure anywhere in between leaves it
flagged (with the reason) until a complete reload succeeds. :func:`direct_reload_session` is the
way to write by hand: leaving its block by an exception can never declare a partial write
complete.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..layout import live_tensors, storage_ptr
from ..state import bridge_state
from .errors import DirectReloadError
from .plan import ReloadPlan, plan_direct_reload
from .proof import module_of
from .readback import ReadBack
from .resolve import Relocation

__all__ = [
    "OpenReload",
    "ReloadReport",
    "Reprocessor",
    "begin_direct_reload",
    "clear_undefined",
    "direct_reload_session",
    "finish_direct_reload",
    "mark_undefined",
    "refresh_derived_state",
    "undefined_reason",
]

WRITING = "a direct reload started writing and did not finish"


class Reprocessor(Protocol):
    """The engine's own per-layer path for modules a direct write cannot serve."""

    def begin(self, modules: list[str]) -> None: ...

    def finish(self) -> None: ...


@dataclass
class ReloadReport:
    """What a direct reload wrote, what it refreshed or re-processed, and how long it took."""

    tensors: int = 0
    bytes: int = 0
    direct: int = 0
    refreshed: dict[str, str] = field(default_factory=dict)
    reprocessed: dict[str, str] = field(default_factory=dict)
    verified_writes: int = 0
    relocations: list[Relocation] = field(default_factory=list)
    preflight_s: float = 0.0
    write_s: float = 0.0
    refresh_s: float = 0.0
    readback_s: float = 0.0
    elapsed_s: float = 0.0
    recovered_from_undefined: str | None = None


@dataclass
class _Session:
    plan: ReloadPlan
    saved: dict[int, tuple[torch.Tensor, torch.Tensor]]  # id -> (tensor object, original data)
    addresses: dict[str, tuple]
    started: float
    was_undefined: str | None
    readback: ReadBack
    reprocessor: Reprocessor | None
    partial: bool = False


def undefined_reason(model: torch.nn.Module) -> str | None:
    """Why the model's weights are undefined (a reload failed mid-way), or None."""
    return bridge_state(model).undefined


def mark_undefined(model: torch.nn.Module, reason: str) -> None:
    """Flag the weights as half-written until a complete reload succeeds."""
    bridge_state(model).undefined = reason


def clear_undefined(model: torch.nn.Module) -> None:
    """Declare the weights whole again (a complete reload by another path succeeded)."""
    bridge_state(model).undefined = None


def _addresses(model: torch.nn.Module) -> dict[str, tuple]:
    return {
        name: (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        for name, t, _ in live_tensors(model)
    }


def begin_direct_reload(
    model: torch.nn.Module,
    reprocessor: Reprocessor | None = None,
    reprocessable: set[str] | frozenset[str] = frozenset(),
    readback: str = "sampled",
    partial: bool = False,
) -> ReloadPlan:
    """Point every directly written parameter at its target; refuse by name what cannot be.

    Nothing has been written when this raises. From here the model is undefined until
    :func:`finish_direct_reload` with ``complete=True`` succeeds. A ``partial`` reload writes a
    subset on top of what the model holds; the engine's re-processing loads whole modules
    from what it is given, so a partial reload that needs it is refused.
    """
    state = bridge_state(model)
    if state.session is not None:
        raise DirectReloadError("a direct reload is already in progress on this model")
    was_undefined = state.undefined
    plan = plan_direct_reload(model, reprocessable if reprocessor is not None else frozenset())
    if plan.problems:
        raise DirectReloadError(
            "not directly reloadable (nothing was written)"
            + (f"; the model is still undefined: {was_undefined}" if was_undefined else ""),
            plan.problems,
        )
    if partial and plan.reprocess:
        raise DirectReloadError(
            "a partial checkpoint cannot be re-processed by the engine, which needs whole "
            "modules: push a complete checkpoint (nothing was written)",
            {module: f"needs re-processing: {why}" for module, why in plan.reprocess.items()},
        )
    addresses = _addresses(model)
    live = {name: t for name, t, _ in live_tensors(model)}
    saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, target in plan.targets.items():
        tensor = live[name]
        if id(tensor) not in saved:
            saved[id(tensor)] = (tensor, tensor.data)
            tensor.data = target.view
    storages = {storage_ptr(t.view) for t in plan.targets.values()}
    state.undefined = was_undefined or WRITING
    state.session = _Session(
        plan,
        saved,
        addresses,
        time.perf_counter(),
        was_undefined,
        ReadBack(storages, readback),
        reprocessor,
        partial,
    )
    if reprocessor is not None and plan.reprocess:
        reprocessor.begin(sorted(plan.reprocess))
    return plan


def finish_direct_reload(
    model: torch.nn.Module, *, complete: bool, reason: str | None = None
) -> ReloadReport:
    """Restore the live views, audit addresses, and (``complete``) prove and refresh.

    ``complete=True`` says every checkpoint tensor was written: the writes are read back, the
    engine's re-processing finishes, derived state is refreshed, and only then is the model
    declared whole. ``complete=False`` restores the views and leaves the model undefined
    (``reason`` says why). Any failure here leaves it undefined and raises.
    """
    state = bridge_state(model)
    session: _Session | None = state.session
    if session is None:
        raise DirectReloadError("finish_direct_reload called without begin_direct_reload")
    state.session = None
    try:
        if complete and session.reprocessor is not None and session.plan.reprocess:
            session.reprocessor.finish()
    finally:
        for tensor, original in session.saved.values():
            tensor.data = original
    if not complete:
        state.undefined = reason or state.undefined or WRITING
        return ReloadReport(write_s=time.perf_counter() - session.started)
    after = _addresses(model)
    changed = {
        name: f"address/layout changed during reload: {before} -> {after.get(name)}"
        for name, before in session.addresses.items()
        if after.get(name) != before
    }
    if changed:
        state.undefined = "a reload changed parameter addresses"
        raise DirectReloadError("audit failed: the reload moved storages", changed)
    targets = session.plan.targets
    if session.partial:  # what it wrote into, not what it could have
        targets = {n: t for n, t in targets.items() if session.readback.wrote_into(t.view)}
    report = ReloadReport(
        direct=len(targets),
        relocations=[t.relocation for t in targets.values() if t.relocation is not None],
        reprocessed=dict(session.plan.reprocess),
        write_s=time.perf_counter() - session.started,
    )
    started = time.perf_counter()
    bad = session.readback.verify()
    report.verified_writes = len(session.readback.writes)
    report.readback_s = time.perf_counter() - started
    if bad:
        state.undefined = "read-back after the push differs from the checkpoint"
        raise DirectReloadError("read-back failed: the engine does not hold the checkpoint", bad)
    started = time.perf_counter()
    written = {module_of(name)[0] for name in targets}
    refresh = {m: kind for m, kind in session.plan.refresh.items() if m in written}
    report.refreshed = refresh_derived_state(model, refresh)
    report.refresh_s = time.perf_counter() - started
    report.recovered_from_undefined = session.was_undefined
    state.undefined = None
    return report


def refresh_derived_state(model: torch.nn.Module, modules: Iterable[str]) -> dict[str, str]:
    """Re-derive the state of ``modules`` from their written weights with their refreshers;
    module -> kind refreshed. A failure leaves the model undefined, naming the module."""
    state = bridge_state(model)
    live = dict(model.named_modules())
    done: dict[str, str] = {}
    for name in modules:
        refresher = state.refreshers[name]
        try:
            refresher.refresh(live[name])
        except Exception as exc:
            state.undefined = (
                f"refreshing the {refresher.kind} of {name} after the write failed: "
                f"{type(exc).__name__}: {exc}"
            )
            raise DirectReloadError(state.undefined) from exc
        done[name] = refresher.kind
    return done


@dataclass
class OpenReload:
    """What :func:`direct_reload_session` yields: the plan now, the report once it finished."""

    plan: ReloadPlan
    readback: ReadBack
    report: ReloadReport | None = None


@contextlib.contextmanager
def direct_reload_session(
    model: torch.nn.Module,
    reprocessor: Reprocessor | None = None,
    reprocessable: set[str] | frozenset[str] = frozenset(),
    readback: str = "sampled",
    partial: bool = False,
) -> Iterator[OpenReload]:
    """``with direct_reload_session(model) as reload: model.load_weights(...)``.

    Inside the block the parameters carry checkpoint layout and writes are noted for the
    read-back; leaving it normally finishes the reload completely (``reload.report``), leaving
    it by an exception restores the views, keeps the model undefined and lets the exception
    propagate untouched.
    """
    plan = begin_direct_reload(model, reprocessor, reprocessable, readback, partial)
    session: _Session = bridge_state(model).session
    handle = OpenReload(plan, session.readback)
    # a partial reload needs the noted writes to know which modules to refresh
    watch = session.readback if readback != "off" or partial else contextlib.nullcontext()
    try:
        with watch:
            yield handle
    except BaseException as exc:
        finish_direct_reload(
            model,
            complete=False,
            reason=f"direct reload failed after writing started: {type(exc).__name__}: {exc}",
        )
        raise
    handle.report = finish_direct_reload(model, complete=True)
