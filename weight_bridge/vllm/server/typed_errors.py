"""The caller side of vLLM's RL API for a bridged engine: typed errors in every process.

The engine core raises a refused or failed update as the project's own error
(:mod:`~weight_bridge.vllm.core.updates`), but vLLM carries an engine core's exception to another
process as a plain ``Exception`` with its message. The plugin wraps ``LLM.update_weights`` and
``AsyncLLM.update_weights`` with the wrappers here (inert unless the engine is bridged) so that
the caller gets the typed error back, as in process: the push's report, fetched once (the
engine-core utility ``weight_bridge_results``), made into the error by
:func:`~weight_bridge.vllm.report.typed_error`, carrying the report. Those errors
(``DirectReloadError``, ``CheckpointError``) are ``ValueError``\\s: ``vllm serve`` answers 400.

``start_weight_update`` is wrapped the same way: a start refused because another update is
active raises :class:`~weight_bridge.vllm.core.updates.UpdateConflictError` (an
:class:`~weight_bridge.vllm.errors.UpdateInProgressError`, ``409 Conflict`` over HTTP), rebuilt
from the engine core's ``weight_bridge_conflict`` utility.
"""

from __future__ import annotations

from typing import Any

from ...checkpoint import CheckpointError
from ...direct import DirectReloadError
from ..core.updates import UpdateConflictError
from ..errors import UpdateInProgressError
from ..internals.engine_client import call_core_utility, call_core_utility_async
from ..internals.objects import config_of, core_client_of
from ..options import is_bridged
from ..report import PushReport, typed_error

_UTILITY = "weight_bridge_results"
_CONFLICT = "weight_bridge_conflict"


def update_report(core_client: Any) -> PushReport | None:
    """The last update's report, from an ``LLM``'s engine-core client (None: none yet)."""
    return PushReport.from_dict(call_core_utility(core_client, _UTILITY))


async def update_report_async(core_client: Any) -> PushReport | None:
    """The same, from an ``AsyncLLM``'s engine-core client."""
    return PushReport.from_dict(await call_core_utility_async(core_client, _UTILITY))


def _typed(error: Exception, report: PushReport | None) -> Exception:
    return typed_error(report) or error


def _conflict(error: Exception, conflict: dict | None) -> Exception:
    return error if conflict is None else UpdateConflictError.active(**conflict)


def typed_start_weight_update(original: Any) -> Any:
    """``LLM.start_weight_update``: a start refused by the engine core as the typed error."""

    def start_weight_update(self):
        try:
            return original(self)
        except UpdateInProgressError:
            raise
        except Exception as exc:
            if not is_bridged(config_of(self)):
                raise
            conflict = call_core_utility(core_client_of(self), _CONFLICT)
            raise _conflict(exc, conflict) from None

    return start_weight_update


def typed_start_weight_update_async(original: Any) -> Any:
    """``AsyncLLM.start_weight_update``, the same."""

    async def start_weight_update_async(self):
        try:
            return await original(self)
        except UpdateInProgressError:
            raise
        except Exception as exc:
            if not is_bridged(config_of(self)):
                raise
            conflict = await call_core_utility_async(core_client_of(self), _CONFLICT)
            raise _conflict(exc, conflict) from None

    return start_weight_update_async


def typed_update_weights(original: Any) -> Any:
    """``LLM.update_weights``: a refused or failed update as the typed error."""

    def update_weights(self, request):
        try:
            return original(self, request)
        except (DirectReloadError, CheckpointError):
            raise
        except Exception as exc:
            if not is_bridged(config_of(self)):
                raise
            raise _typed(exc, update_report(core_client_of(self))) from None

    return update_weights


def typed_update_weights_async(original: Any) -> Any:
    """``AsyncLLM.update_weights``, the same."""

    async def update_weights_async(self, request):
        try:
            return await original(self, request)
        except (DirectReloadError, CheckpointError):
            raise
        except Exception as exc:
            if not is_bridged(config_of(self)):
                raise
            raise _typed(exc, await update_report_async(core_client_of(self))) from None

    return update_weights_async
