"""The caller side of vLLM's RL API for a bridged engine: typed errors in every process.

The engine core raises a refused or failed update as the project's own error
(:mod:`.core_hooks`), but vLLM carries an engine core's exception to another process as a plain
``Exception`` with its message. The plugin wraps ``LLM.update_weights`` and
``AsyncLLM.update_weights`` (inert unless the engine is bridged) so that the caller gets the
typed error back, rebuilt from every rank's result (the engine-core utility
``weight_bridge_results``): :class:`~weight_bridge.direct.DirectReloadError` or
:class:`~weight_bridge.checkpoint.CheckpointError` with ``.problems`` naming each tensor, in
the caller's own process as in-process. Both are ``ValueError``\\s, which ``vllm serve``
answers with 400 and the message (no traceback in its log).

``start_weight_update`` is wrapped the same way: a start refused because another update is
active raises :class:`~.core_hooks.UpdateConflictError` (an
:class:`~.results.UpdateInProgressError`, ``409 Conflict`` over HTTP), rebuilt from the engine
core's ``weight_bridge_conflict`` utility.
"""

from __future__ import annotations

from typing import Any

from ..checkpoint import CheckpointError
from ..direct import DirectReloadError
from .core_hooks import UpdateConflictError
from .options import is_bridged
from .results import PushResult, UpdateInProgressError, merged_error

__all__ = ["install", "update_results", "update_results_async"]

_installed = False
_UTILITY = "weight_bridge_results"
_CONFLICT = "weight_bridge_conflict"


def update_results(core_client: Any) -> list[PushResult]:
    """Every rank's result of the last update, from an ``LLM``'s engine-core client."""
    return [PushResult.from_dict(r) for r in _utility(core_client, _UTILITY)]


async def update_results_async(core_client: Any) -> list[PushResult]:
    """The same, from an ``AsyncLLM``'s engine-core client."""
    raw = await core_client.call_utility_async(_UTILITY)
    return [PushResult.from_dict(r) for r in raw]


def _typed(error: Exception, results: list[PushResult]) -> Exception:
    return merged_error(results) or error


def _conflict(error: Exception, conflict: dict | None) -> Exception:
    return error if conflict is None else UpdateConflictError.active(**conflict)


def _utility(core_client: Any, name: str) -> Any:
    inproc = getattr(core_client, "engine_core", None)
    if inproc is not None and hasattr(inproc, name):  # InprocClient holds the core itself
        return getattr(inproc, name)()
    return core_client.call_utility(name)


def install() -> None:
    """Wrap ``update_weights`` of vLLM's offline (``LLM``) and async (``AsyncLLM``) APIs."""
    global _installed
    if _installed:
        return
    _installed = True
    from vllm.entrypoints.rl.offline import RLOfflineMixin
    from vllm.v1.engine.async_llm import AsyncLLM

    offline = RLOfflineMixin.update_weights
    online = AsyncLLM.update_weights
    offline_start = RLOfflineMixin.start_weight_update
    online_start = AsyncLLM.start_weight_update

    def start_weight_update(self):
        try:
            return offline_start(self)
        except UpdateInProgressError:
            raise
        except Exception as exc:
            if not is_bridged(self.llm_engine.vllm_config):
                raise
            raise _conflict(exc, _utility(self.llm_engine.engine_core, _CONFLICT)) from None

    async def start_weight_update_async(self):
        try:
            return await online_start(self)
        except UpdateInProgressError:
            raise
        except Exception as exc:
            if not is_bridged(self.vllm_config):
                raise
            conflict = await self.engine_core.call_utility_async(_CONFLICT)
            raise _conflict(exc, conflict) from None

    def update_weights(self, request):
        try:
            return offline(self, request)
        except (DirectReloadError, CheckpointError):
            raise
        except Exception as exc:
            if not is_bridged(self.llm_engine.vllm_config):
                raise
            raise _typed(exc, update_results(self.llm_engine.engine_core)) from None

    async def update_weights_async(self, request):
        try:
            return await online(self, request)
        except (DirectReloadError, CheckpointError):
            raise
        except Exception as exc:
            if not is_bridged(self.vllm_config):
                raise
            raise _typed(exc, await update_results_async(self.engine_core)) from None

    RLOfflineMixin.update_weights = update_weights  # type: ignore[method-assign]
    AsyncLLM.update_weights = update_weights_async  # type: ignore[method-assign]
    RLOfflineMixin.start_weight_update = start_weight_update  # type: ignore[method-assign]
    AsyncLLM.start_weight_update = start_weight_update_async  # type: ignore[method-assign]
