"""The engine-core side of a bridged update: agreement across ranks, errors, the prefix cache.

vLLM's ``LLM``, ``AsyncLLM`` and HTTP routes all reach the workers through the engine core's
``collective_rpc``; for a bridged engine the plugin wraps it (:func:`bridged_collective_rpc`, in
the engine-core process) so that one ``update_weights`` is a transaction over every rank, run in
one place (:func:`_update`) through the phases of :class:`~weight_bridge.vllm.outcome.Phase`,
each answered by every rank. What it guarantees:

1. every rank *prepares* first (``PREPARE``, sent by the core itself, since vLLM's worker
   ``update_weights`` discards what its backend returns): the whole checkpoint checked, every
   weight planned, nothing written; the version served is passed along as a partial's base;
2. every rank *commits* only if every rank prepared; if any rank then failed past its first
   write, every rank that wrote *rolls back* to the version served;
3. the report (:class:`~weight_bridge.vllm.report.PushReport`) is built here once and kept for
   the utility ``weight_bridge_results``; a refusal or failure is raised from ``update_weights``
   as :func:`~weight_bridge.vllm.report.typed_error` makes it (logged on one line), a success's
   report is returned (vLLM discards it:
   :func:`~weight_bridge.vllm.server.typed_errors.update_report` fetches it). After a failure
   the workers' session is closed and its ``finish_weight_update`` refused, so vLLM stamps no
   version that was not written;
4. after a successful update no later request reuses KV computed by the old weights
   (:func:`~weight_bridge.vllm.internals.engine_core.forget_prefixes`; vLLM's own update keeps
   the prefix cache);
5. **the weights and their label change together**: the new version (the request's ``version``,
   else the checkpoint's metadata, else its file name) is stamped in the call that commits the
   write (an adapter's names its LoRA slot instead, :mod:`.adapters`), so no engine step runs
   new weights under the old label or the reverse (vLLM writes at ``update_weights`` and stamps
   at ``finish_weight_update``, generating in between). A
   ``finish_weight_update(weight_version=V)`` with another ``V`` relabels from then on;
6. **one update at a time**: a ``start_weight_update`` while another is active is refused with
   :class:`UpdateConflictError` (a :class:`~weight_bridge.vllm.errors.UpdateInProgressError`,
   ``409`` from ``vllm serve``) before it reaches a worker, naming since when and which version;
   an update silent for ``update_timeout_s`` (its trainer died) is abandoned by the next start,
   and ``finish_weight_update`` ends one at once;
7. the core waits for the workers asleep, not spinning, so their push helpers get the CPU vLLM
   reserves for it;
8. while a rank is *undefined* (rollback failed or is off) the engine schedules nothing and ends
   every request with the reason until a complete update succeeds (:mod:`.undefined`).

The same wrapper routes :data:`~weight_bridge.vllm.options.BACKEND_RPC` to the workers'
read-only actions (:mod:`~weight_bridge.vllm.worker.queries`). Workers never raise
(:meth:`~weight_bridge.vllm.worker.transaction.PushTransaction.run`): vLLM's multi-process
executor raises at the first failed rank and leaves the others' replies queued. In the trainer's
ranks each rank's core hears every core's answers
(:func:`~weight_bridge.vllm.internals.engine_core.across_engine_ranks`), so every rank decides
alike; a worker call that raised anyway is that rank's answer (:func:`_phase`), and a failed step
of the core's own rolls every writer back (:func:`_core_failed`): no rank waits for another and no
label is stamped on bits it does not name.
"""

from __future__ import annotations

import contextlib
import logging
import time
from http import HTTPStatus
from typing import Any

from vllm.exceptions import GracefulHTTPError

from ...checkpoint import CheckpointError, version_of
from ...direct import DirectReloadError
from ..errors import UpdateInProgressError
from ..internals.engine_core import (
    across_engine_ranks,
    forget_prefixes,
    served_version,
    waiting_without_spinning,
)
from ..internals.objects import config_of
from ..options import BACKEND_RPC, BridgeOptions, bridge_options, is_bridged
from ..outcome import Phase, PushResult, merged_error, shard_fingerprint_problems
from ..report import PushReport, typed_error
from ..worker.backend import QUERIES, call_backend
from .adapters import resident_after, retiring_in_use, weight_bridge_adapters
from .state import ActiveUpdate, core_state
from .undefined import resume_if_paused, stop_scheduling

_logger = logging.getLogger(__name__)
_HOOKED = ("start_weight_update", "update_weights", "finish_weight_update")


class UpdateConflictError(UpdateInProgressError, GracefulHTTPError):
    """:class:`~weight_bridge.vllm.errors.UpdateInProgressError` as vLLM's API server answers it:
    ``409 Conflict`` with the message (vLLM's ``GracefulHTTPError``), no traceback."""

    http_status = HTTPStatus.CONFLICT


def _phase(rpc: Any, core: Any, timeout: float | None, phase: Phase, *args: Any) -> list:
    """Every rank's :class:`PushResult` for ``phase``. A worker answers whatever the phase
    raised (:meth:`~weight_bridge.vllm.worker.transaction.PushTransaction.run`); a call that
    raised anyway (a worker that died, a message that could not travel) is this rank's answer
    too (:meth:`PushResult.unanswered`), so this core still reaches the exchange every other
    rank's core waits in (:func:`~weight_bridge.vllm.internals.engine_core.across_engine_ranks`)."""
    try:
        local = rpc(core, call_backend, timeout, (phase.value, *args))
    except Exception as exc:
        local = [PushResult.unanswered(phase, exc).to_dict()]
    return PushResult.every_rank(across_engine_ranks(core, local))


def weight_bridge_results(self: Any) -> dict | None:
    """Engine-core utility: the last update's :class:`~weight_bridge.vllm.report.PushReport`,
    as a dict (None before the first, or while one runs): the caller rebuilds the report and
    the typed error from it (:func:`~weight_bridge.vllm.report.typed_error`)."""
    return core_state(self).report


def weight_bridge_conflict(self: Any) -> dict | None:
    """Engine-core utility: the last refused ``start_weight_update``'s error, as a dict."""
    return core_state(self).conflict


def _claim(rpc: Any, core: Any, timeout: float | None) -> None:
    """Make this start the engine's one active update, or refuse it by name. An active update
    idle for ``update_timeout_s`` is abandoned first (its workers' session closed; what it
    committed was stamped with its label when it was written)."""
    state = core_state(core)
    active = state.active
    if active is not None:
        limit = (bridge_options(config_of(core)) or BridgeOptions()).update_timeout_s
        idle = time.monotonic() - active.last_call
        if idle < limit:
            error = UpdateConflictError.active(active.since, active.version, limit - idle)
            state.conflict = error.to_dict()
            raise error
        _logger.warning(
            "weight_bridge: abandoning the update started %.1f s ago (no call for %.1f s, "
            "update_timeout_s=%s)",
            time.time() - active.since,
            idle,
            limit,
        )
        state.active = None
        with contextlib.suppress(Exception):
            rpc(core, "finish_weight_update", timeout, (), None)  # close the workers' session
    state.conflict = None
    state.report = None  # an answer about this update is never an earlier one's
    state.active = ActiveUpdate(time.time(), time.monotonic())


def _asked_version(info: Any) -> str | None:
    first = info[0] if isinstance(info, list) and info else info
    version = first.get("version") if isinstance(first, dict) else None
    return None if version is None else str(version)


def _label(asked: str | None, results: list[PushResult]) -> str:
    """The version the new weights are stamped with: the request's, else the project's one
    default rule (:func:`~weight_bridge.checkpoint.version_of`)."""
    if asked is not None:
        return asked
    return version_of(results[0].checkpoint, results[0].version)


def _with_served(info: Any, served: str | None) -> Any:
    if isinstance(info, list):
        return [_with_served(i, served) for i in info]
    if isinstance(info, dict):
        return {**info, "served_version": served}
    return info


def _update(rpc: Any, core: Any, timeout: float | None, info: Any) -> PushReport:
    """THE update on this rank's engine core, the one place that runs its phases: each phase
    answered by every rank and agreed (:func:`_phase`), its outcome built from those answers
    whatever any rank raised: refused with nothing written, rolled back, or undefined naming
    why; or the new weights under their label."""
    state = core_state(core)
    served = served_version(core)
    results = _phase(rpc, core, timeout, Phase.PREPARE, _with_served(info, served))
    if merged_error(results) is not None:  # a rank refused: no rank writes
        return _ended(rpc, core, timeout, _phase(rpc, core, timeout, Phase.ABANDON), served)
    busy = retiring_in_use(core, results)
    if busy is not None:  # refused here: every rank prepared, none writes
        return PushReport.of(_phase(rpc, core, timeout, Phase.ABANDON), None, busy)
    results = _phase(rpc, core, timeout, Phase.COMMIT)
    if merged_error(results) is None:
        state.updates += 1
        why, wrong = _after_commit(core, results, f"weight-bridge-{state.updates}-{served}")
        if why is not None:
            results = _phase(rpc, core, timeout, Phase.FAIL, why, wrong)
    if merged_error(results) is None:
        return PushReport.of(results, _label(_asked_version(info), results))
    return _ended(rpc, core, timeout, results, served)


def _after_commit(core: Any, results: list[PushResult], salt: str) -> tuple[str | None, dict]:
    """Why the update fails after every rank committed (None: it does not), and the tensors
    named: a delta's fingerprints that do not add up over the tensor-parallel ranks, or a
    prefix-cache reset that failed on any rank (agreed on every rank)."""
    try:
        wrong = shard_fingerprint_problems(results)
    except Exception as exc:
        return f"the ranks' fingerprints could not be checked ({type(exc).__name__}: {exc})", {}
    if wrong:
        return "a delta's fingerprints, summed over the tensor-parallel ranks, do not check", wrong
    return _forget_prefixes_on_every_rank(core, salt), {}


def _ended(
    rpc: Any, core: Any, timeout: float | None, results: list[PushResult], served: str | None
) -> PushReport:
    """A refused or failed update's report, every rank that wrote rolled back first."""
    error = merged_error(results)
    if any(r.wrote for r in results):
        results = _phase(rpc, core, timeout, Phase.ROLL_BACK, served)
        error = merged_error(results) or error
    undefined = next((r.undefined for r in results if r.undefined), None)
    return PushReport.of(results, None, str(error), undefined)


def _answered(rpc: Any, core: Any, timeout: float | None, report: PushReport) -> list:
    """Make ``report`` the engine's: kept for ``weight_bridge_results``; a success stamps its
    label in this same engine-core call (no step runs in between) and is returned to the call
    that made the update; a refusal or failure ends the workers' session and is raised as the
    typed error (:func:`~weight_bridge.vllm.report.typed_error`)."""
    state = core_state(core)
    if report.failed is None:
        state.adapters = resident_after(state.adapters, report)
    report.adapters = dict(state.adapters)
    state.report = report.to_dict()
    if report.failed is None:
        if report.results[0].adapter is None:  # the engine's label names the base weights
            core.set_weight_version(report.version)
        state.failed = None
        resume_if_paused(core, state)
        if state.active is not None:
            state.active.last_call = time.monotonic()
        return [state.report]
    with contextlib.suppress(Exception):
        rpc(core, "finish_weight_update", timeout, (), None)  # close the workers' session
    state.active = None
    state.failed = report.failed
    if report.undefined is not None:
        stop_scheduling(core, state, report.undefined)
    raise typed_error(report) or DirectReloadError(report.failed)


def _core_failed(rpc: Any, core: Any, timeout: float | None, exc: Exception) -> PushReport:
    """An update whose engine-core step raised between two phases (its own code, on the answers
    every rank shares, so on every rank alike): every rank that wrote rolls back."""
    why = f"the engine core's update raised {type(exc).__name__}: {exc}"
    _logger.exception("weight_bridge: %s", why)
    results = _phase(rpc, core, timeout, Phase.ROLL_BACK, served_version(core))
    undefined = next((r.undefined for r in results if r.undefined), None)
    return PushReport.of(results, None, why, undefined)


def _forget_prefixes_on_every_rank(core: Any, salt: str) -> str | None:
    """Why the prefix-cache reset failed on any rank (None: on none): the cores agree, or a
    rank that failed alone waits in the next phase's exchange for ranks that went on."""
    why = None
    try:
        forget_prefixes(core, salt)
    except Exception as exc:
        why = f"prefix cache reset failed after the update ({type(exc).__name__}: {exc})"
    failed = [w for w in across_engine_ranks(core, [why]) if w is not None]
    return f"{failed[0]}: its cached KV may be from the old weights" if failed else None


def _query(rpc: Any, core: Any, timeout: float | None, args: tuple, kwargs: dict | None) -> list:
    """A read-only :func:`~weight_bridge.vllm.worker.backend.call_backend` action, by name."""
    if not args or args[0] not in QUERIES:
        raise ValueError(f"{BACKEND_RPC}: the first argument must be one of {QUERIES}")
    return rpc(core, call_backend, timeout, args, kwargs)


def bridged_collective_rpc(original: Any) -> Any:
    """``EngineCore.collective_rpc``, each update a transaction over every rank (inert unless
    the engine is bridged), :data:`BACKEND_RPC` routed to :func:`call_backend`."""

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if isinstance(method, str) and method == BACKEND_RPC:
            return _query(original, self, timeout, args, kwargs)
        if not (isinstance(method, str) and method in _HOOKED and is_bridged(config_of(self))):
            return original(self, method, timeout, args, kwargs)
        state = core_state(self)
        if method == "start_weight_update":
            _claim(original, self, timeout)
            try:
                started: Any = original(self, method, timeout, args, kwargs)
            except BaseException:
                state.active = None
                raise
            state.failed = None
            return started
        if method == "update_weights":
            if state.active is None:  # vLLM's own contract, which its worker checked
                state.report = None
                raise DirectReloadError(
                    "start_weight_update must be called before update_weights (nothing was written)"
                )
            info = (kwargs or {}).get("update_info", args[0] if args else None)
            state.report = None  # nothing of an earlier update may stand for this one
            state.active.last_call = time.monotonic()
            state.active.version = _asked_version(info)
            try:
                with waiting_without_spinning(self):  # the push's helpers get its CPU
                    try:
                        report = _update(original, self, timeout, info)
                    except Exception as exc:  # the core's own step raised: take back any write
                        report = _core_failed(original, self, timeout, exc)
                return _answered(original, self, timeout, report)
            except (DirectReloadError, CheckpointError):
                raise
            except BaseException:
                # Not an outcome of the update (an interrupt, a worker that died): the workers'
                # session must not stay open, or no update could ever start again.
                with contextlib.suppress(Exception):
                    original(self, "finish_weight_update", timeout, (), None)
                state.active = None
                state.failed = "the last update did not finish"
                raise
        state.active = None  # finish_weight_update: the update ends, whoever calls it
        if state.failed is not None:
            failed, state.failed = state.failed, None
            raise RuntimeError(
                "finish_weight_update after a failed update_weights: nothing was updated, the "
                f"engine serves version {served_version(self)!r} ({failed.splitlines()[0]})"
            )
        state.failed = None
        return original(self, method, timeout, args, kwargs)

    return collective_rpc


def quiet_refusals(record: logging.LogRecord) -> bool:
    """vLLM logs every failed utility call with its traceback; a refused or rolled-back update
    is an expected outcome, already in the error the caller gets: one line, no traceback."""
    error = record.exc_info[1] if record.exc_info else None
    if isinstance(error, (DirectReloadError, CheckpointError, UpdateInProgressError)):
        record.msg = "weight_bridge: update refused: %s"
        record.args = (str(error).splitlines()[0],)
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info, record.exc_text = None, None
    return True


#: The engine-core utilities the bridge adds (name -> function of the core).
UTILITIES = {
    "weight_bridge_results": weight_bridge_results,
    "weight_bridge_conflict": weight_bridge_conflict,
    "weight_bridge_adapters": weight_bridge_adapters,
}
