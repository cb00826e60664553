"""The bridge's two ``vllm serve`` middlewares (vLLM's ``--middleware``, HTTP functions).

1. :func:`update_results_route`: ``GET /weight_bridge/results`` answers the last update's
   outcome as the engine core built it (its ``weight_bridge_results``: every worker's result,
   the label stamped), from which :class:`~weight_bridge.vllm.clients.http.HTTPClient` builds
   the same report, served chain and typed errors as the in-process clients. While that
   outcome leaves the weights undefined, a request vLLM fails with its bare ``500 Internal
   server error`` (the engine core ends each one with the reason, which vLLM's API server drops)
   is answered ``503`` with the reason instead, as an OpenAI error body of type
   ``EngineUndefinedError``.
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

__all__ = ["OPEN_ROUTES", "require_api_key", "update_results_route"]

OPEN_ROUTES = frozenset({"/health", "/ping", "/version"})


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
    if path == "/weight_bridge/results" and request.method == "GET":
        core = server_core_client(request)
        return JSONResponse(await call_core_utility_async(core, "weight_bridge_results"))
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
