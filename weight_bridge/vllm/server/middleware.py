"""The bridge's two ``vllm serve`` middlewares (vLLM's ``--middleware``, HTTP functions).

1. :func:`update_results_route`: ``GET /weight_bridge/results`` answers the last update's
   outcome as the engine core built it (its ``weight_bridge_results``: every worker's result,
   the label stamped), from which :class:`~weight_bridge.vllm.clients.http.HTTPClient` builds
   the same report, served chain and typed errors as the in-process clients. While that
   outcome leaves the weights undefined, a request vLLM fails with its bare ``500 Internal
   server error`` (the engine core ends each one with the reason, which vLLM's API server drops)
   is answered ``503`` with the reason instead, as an OpenAI error body of type
   ``EngineUndefinedError``. ``POST /weight_bridge/pause?mode=wait&clear_cache=...`` pauses
   generation for a ``drain`` push with the requests that arrive meanwhile *queued*
   (:func:`~weight_bridge.vllm.internals.pause_queueing`, as in process): vLLM 0.33+'s own
   ``/pause?mode=wait`` rejects them with ``503`` until ``/resume``, so every other client of the
   server (the ``openai`` package, an evaluator) would see failed requests at every sync.
2. :func:`require_api_key`: the API key on every route that can change what the server
   serves.

vLLM 0.32's ``--api-key`` guards only paths under ``/v1``, ``/v2``, ``/inference`` and
``/cohere``; with ``VLLM_SERVER_DEV_MODE=1`` the RL routes (``/pause``, ``/update_weights``,
``/finish_weight_update``...) and the development routes (``/collective_rpc``...) answer anyone
who can reach the port (measured). Add this middleware to such a server::

    python -m vllm.entrypoints.openai.api_server ... --api-key KEY \\
        --middleware weight_bridge.vllm.server.middleware.require_api_key

and every route but the health and version probes needs ``Authorization: Bearer KEY`` (the
keys of ``--api-key``, else ``VLLM_API_KEY``); without a key configured it lets everything
through, as vLLM does. :class:`~weight_bridge.vllm.clients.served.VLLMServer` adds it whenever it
starts a server with an ``api_key``.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from ..errors import EngineUndefinedError, undefined_message

__all__ = ["OPEN_ROUTES", "PAUSE_ROUTE", "RESULTS_ROUTE", "require_api_key", "update_results_route"]

OPEN_ROUTES = frozenset({"/health", "/ping", "/version"})
RESULTS_ROUTE = "/weight_bridge/results"  # the bridge's routes, served here, called by HTTPClient
PAUSE_ROUTE = "/weight_bridge/pause"


def _keys(request: Any) -> list[str]:
    args = getattr(request.app.state, "args", None)
    given = list(getattr(args, "api_key", None) or [])
    return [k for k in (given or [os.environ.get("VLLM_API_KEY", "")]) if k]


def _authorized(header: str | None, keys: list[str]) -> bool:
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    digest = hashlib.sha256(token.encode()).digest()
    return any(secrets.compare_digest(digest, hashlib.sha256(k.encode()).digest()) for k in keys)


async def require_api_key(request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
    """vLLM ``--middleware`` (an HTTP function): 401 for any route but :data:`OPEN_ROUTES`
    without the server's key."""
    path = request.url.path.removeprefix(request.scope.get("root_path", ""))
    keys = _keys(request)
    guarded = keys and path not in OPEN_ROUTES and request.method != "OPTIONS"
    if guarded and not _authorized(request.headers.get("Authorization"), keys):
        from starlette.responses import JSONResponse

        return JSONResponse({"error": "Unauthorized"}, status_code=401)
    return await call_next(request)


async def update_results_route(request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
    """vLLM ``--middleware``: ``GET /weight_bridge/results``, the last update's
    :class:`~weight_bridge.vllm.outcome.PushOutcome` as JSON (``null`` before the first); every
    other request goes on, and one that vLLM fails with a 500 while that outcome leaves the
    weights undefined is answered 503 with the reason. Give it before :func:`require_api_key`,
    which then guards it."""
    from starlette.responses import JSONResponse

    from ..internals import call_core_utility_async, server_core_client

    path = request.url.path.removeprefix(request.scope.get("root_path", ""))
    if path == RESULTS_ROUTE and request.method == "GET":
        core = server_core_client(request)
        return JSONResponse(await call_core_utility_async(core, "weight_bridge_results"))
    if path == PAUSE_ROUTE and request.method == "POST":
        return await _pause_queueing(request)
    response = await call_next(request)
    if response.status_code != HTTPStatus.INTERNAL_SERVER_ERROR:
        return response
    outcome = await call_core_utility_async(server_core_client(request), "weight_bridge_results")
    why = (outcome or {}).get("undefined")
    if not why:
        return response  # another failure: vLLM's answer as it is
    error = {
        "message": undefined_message(why),
        "type": EngineUndefinedError.__name__,
        "param": None,
        "code": HTTPStatus.SERVICE_UNAVAILABLE,
    }
    return JSONResponse({"error": error}, status_code=HTTPStatus.SERVICE_UNAVAILABLE)


async def _pause_queueing(request: Any) -> Any:
    """``POST /weight_bridge/pause?mode=...&clear_cache=...``: vLLM's pause with the requests
    that arrive meanwhile queued until ``/resume``, never rejected."""
    from starlette.responses import JSONResponse

    from ..internals import pause_queueing, server_engine

    mode = request.query_params.get("mode", "wait")
    clear_cache = request.query_params.get("clear_cache", "false").lower() == "true"
    if mode not in ("wait", "keep"):
        error = {"message": f"mode must be 'wait' or 'keep', not {mode!r}", "type": "BadRequest"}
        return JSONResponse({"error": error}, status_code=HTTPStatus.BAD_REQUEST)
    await pause_queueing(server_engine(request), mode, clear_cache)
    return JSONResponse({"status": "paused", "mode": mode})
