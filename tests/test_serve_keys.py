"""Issue 56.3: every route the bridge adds to ``vllm serve`` checks the API key itself.

The middlewares (:mod:`weight_bridge.vllm.server.middleware`) first on a small FastAPI app, the
type vLLM's API server is, with the middlewares added as vLLM adds ``--middleware`` (each
``app.middleware("http")``, in the order given: the last one outermost) and the routes vLLM
serves with and without ``VLLM_SERVER_DEV_MODE=1``, behind a stand-in engine; over Starlette's
real HTTP stack (``TestClient``): every bridge route and vLLM's RL routes, with and without the
key, in both middleware orders, with and without dev mode, and a pause that nothing follows
released after the engine's ``update_timeout_s``. Then end to end on one real ``vllm serve``
started with vLLM's own ``--api-key`` and *without* dev mode (the server on which an anonymous
pause used to be forever: vLLM serves no ``/resume`` there), whose only middleware is the
bridge's results route. (Servers with dev mode: ``tests/test_serve.py``.)
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
from helpers import SERVE_ARGS

from weight_bridge.vllm.clients.served import VLLMServer
from weight_bridge.vllm.options import BridgeOptions
from weight_bridge.vllm.server import middleware
from weight_bridge.vllm.server.middleware import PAUSE_ROUTE, RESULTS_ROUTE

KEY = "the-key"
# As vLLM's ``--middleware`` gives them: the last one is the outermost.
ORDERS = (
    ("update_results_route",),
    ("update_results_route", "require_api_key"),
    ("require_api_key", "update_results_route"),
)
# vLLM's routes that change what the server serves, served only with VLLM_SERVER_DEV_MODE=1.
DEV_ROUTES = ("/pause", "/resume", "/update_weights", "/start_weight_update", "/collective_rpc")


class Engine:
    """A stand-in for the server's ``AsyncLLM``: what the middleware calls on it."""

    def __init__(self, update_timeout_s: float) -> None:
        self.paused = False
        self.resumed = 0
        options = BridgeOptions(checkpoint_root="/", update_timeout_s=update_timeout_s)
        self.vllm_config = SimpleNamespace(
            weight_transfer_config=SimpleNamespace(backend="weight_bridge"),
            additional_config=options.as_config(),
        )
        self.engine_core = SimpleNamespace(
            call_utility_async=self._utility, pause_scheduler_async=self._pause
        )

    async def _utility(self, name: str) -> dict | None:
        assert name == "weight_bridge_results"
        return None

    async def _pause(self, mode: str, clear_cache: bool) -> None:
        self.paused = True

    async def is_paused(self) -> bool:
        return self.paused

    async def resume_generation(self) -> None:
        self.paused, self.resumed = False, self.resumed + 1


def _app(order: tuple[str, ...], dev: bool, key: str | None, timeout_s: float = 60.0):
    from fastapi import FastAPI

    app = FastAPI()
    engine = Engine(timeout_s)
    app.state.args = argparse.Namespace(api_key=[key] if key else None)
    app.state.engine_client = engine

    async def ok() -> dict:
        return {"ok": True}

    async def pause() -> dict:
        engine.paused = True
        return {}

    async def resume() -> dict:
        await engine.resume_generation()
        return {}

    app.get("/health")(ok)
    app.post("/v1/completions")(ok)
    if dev:
        for route in DEV_ROUTES:
            app.post(route)({"/pause": pause, "/resume": resume}.get(route, ok))
    for name in order:
        app.middleware("http")(getattr(middleware, name))
    return app, engine


def _bearer(key: str | None) -> dict:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def _ask(client, method: str, route: str, key: str | None) -> int:
    return int(client.request(method, route, headers=_bearer(key)).status_code)


@pytest.mark.every_vllm
@pytest.mark.parametrize("dev", [True, False], ids=["dev-mode", "no-dev-mode"])
def test_every_route_needs_the_key_whatever_the_middleware_order(monkeypatch, dev) -> None:
    """With a key: no key or a wrong one is 401 on the bridge's routes and on vLLM's (nothing
    paused), in either order of the two middlewares and with the results route alone; the key
    lets each through (vLLM's RL routes then answer 404 without dev mode, the bridge's pause
    is served: a key guards it); the health probe needs none."""
    from starlette.testclient import TestClient

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    routes = [("GET", RESULTS_ROUTE), ("POST", PAUSE_ROUTE), ("POST", "/v1/completions")]
    routes += [("POST", route) for route in DEV_ROUTES]
    for order in ORDERS:
        app, engine = _app(order, dev, KEY)
        with TestClient(app) as client:
            for method, route in routes:
                for key in (None, "wrong", ""):
                    answer = client.request(method, route, headers=_bearer(key))
                    assert answer.status_code == 401, (order, method, route, key)
                    assert answer.json() == {"error": "Unauthorized"}
                assert not engine.paused, (order, route)
            for method, route in routes:
                served = dev or route not in DEV_ROUTES
                assert _ask(client, method, route, KEY) == (200 if served else 404), (order, route)
            assert _ask(client, "GET", "/health", None) == 200


@pytest.mark.every_vllm
def test_without_a_key_the_bridges_pause_is_served_only_where_vllm_serves_resume(
    monkeypatch,
) -> None:
    """No key configured (everything open, as vLLM): the bridge's pause answers and pauses
    where vLLM serves ``/resume`` (dev mode); without dev mode it is ``404``, as a route that
    does not exist, and nothing is paused (nobody could resume it). The results route answers
    either way."""
    from starlette.testclient import TestClient

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    for order in ORDERS:
        for dev in (True, False):
            app, engine = _app(order, dev, None)
            with TestClient(app) as client:
                assert _ask(client, "GET", RESULTS_ROUTE, None) == 200
                assert _ask(client, "POST", PAUSE_ROUTE, None) == (200 if dev else 404)
                assert engine.paused == dev, (order, dev)


@pytest.mark.every_vllm
def test_a_pause_nothing_follows_is_released_after_the_update_timeout(monkeypatch, caplog) -> None:
    """The bridge's pause, then nothing for the engine's ``update_timeout_s``: generation is
    resumed, with a warning. A pause that an update start, vLLM's own pause or a resume
    follows is not the bridge's to release: after the timeout the engine is as that call left
    it."""
    from starlette.testclient import TestClient

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    timeout_s = 0.3
    app, engine = _app(ORDERS[0], True, KEY, timeout_s)
    logger = middleware._logger  # vLLM's: it may not propagate to pytest's handler
    monkeypatch.setattr(logger, "handlers", [*logger.handlers, caplog.handler])
    with caplog.at_level(logging.WARNING, logger=logger.name), TestClient(app) as client:
        started = time.monotonic()
        assert _ask(client, "POST", PAUSE_ROUTE, KEY) == 200 and engine.paused
        while engine.paused and time.monotonic() - started < 10:
            time.sleep(0.02)
        assert not engine.paused and engine.resumed == 1
        assert time.monotonic() - started >= timeout_s
        assert "no update followed" in caplog.text
        for follow in ("/start_weight_update", "/pause", "/resume"):
            assert _ask(client, "POST", PAUSE_ROUTE, KEY) == 200 and engine.paused
            assert _ask(client, "POST", follow, KEY) == 200
            paused, resumed = engine.paused, engine.resumed
            time.sleep(timeout_s * 3)
            assert (engine.paused, engine.resumed) == (paused, resumed), follow
            if engine.paused:
                assert _ask(client, "POST", "/resume", KEY) == 200


@pytest.mark.every_vllm
@pytest.mark.parametrize("dev", [True, False], ids=["dev-mode", "no-dev-mode"])
def test_only_an_authenticated_call_keeps_a_pause_from_its_release(monkeypatch, dev) -> None:
    """Issue 62.3: with a key, a keyed pause followed only by calls that did not pass the key
    check (an anonymous ``OPTIONS /resume``, which vLLM answers 405 or 404, an ``OPTIONS`` with
    the key, a ``POST /resume`` or ``/start_weight_update`` without the key or with a wrong
    one: each refused 401) is still released after ``update_timeout_s``, in every middleware
    order; without a key (dev mode: the pause is served) an ``OPTIONS`` does not follow it
    either. Before, the ``OPTIONS`` counted as the call that follows and the pause held."""
    from starlette.testclient import TestClient

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    timeout_s = 0.3
    keyed = [(None, "OPTIONS", "/resume"), (KEY, "OPTIONS", "/resume")]
    keyed += [(None, "OPTIONS", "/start_weight_update"), (KEY, "OPTIONS", PAUSE_ROUTE)]
    keyed += [(k, "POST", r) for k in (None, "wrong") for r in ("/resume", "/start_weight_update")]
    cases = [(KEY, keyed)] + ([(None, [(None, "OPTIONS", "/resume")])] if dev else [])
    for server_key, follows in cases:
        for order in ORDERS:
            app, engine = _app(order, dev, server_key, timeout_s)
            with TestClient(app) as client:
                started = time.monotonic()
                assert _ask(client, "POST", PAUSE_ROUTE, server_key) == 200 and engine.paused
                for key, method, route in follows:
                    status = _ask(client, method, route, key)
                    assert status in ((401,) if method == "POST" else (404, 405)), (route, status)
                while engine.paused and time.monotonic() - started < 10:
                    time.sleep(0.02)
                assert not engine.paused and engine.resumed == 1, (server_key, order, follows)
                assert time.monotonic() - started >= timeout_s


# -- one real vllm serve: vLLM's --api-key, no dev mode, the results route alone ---------------

RELEASE_S = 3.0  # the server's update_timeout_s


@pytest.fixture(scope="module")
def keyed(api_models):
    """A server on the tied dense Qwen2 (A) with vLLM's own ``--api-key``, the bridge's results
    middleware alone (``require_api_key`` nowhere) and no dev mode."""
    root, models = api_models
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "0"}
    options = BridgeOptions(checkpoint_root=str(root), update_timeout_s=RELEASE_S)
    log = root.parent / "serve-keys.log"
    args = [*SERVE_ARGS, "--api-key", KEY]
    server = VLLMServer(models["dense"][0], options, args, env=env, log=log)
    assert "require_api_key" not in " ".join(server.command())
    server.start()
    yield server
    server.stop()


def _status(url: str, method: str, key: str | None, body: dict | None = None) -> int:
    headers = {"Content-Type": "application/json", **_bearer(key)}
    data = json.dumps(body or {}).encode() if method == "POST" else None
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=RELEASE_S + 60) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


@pytest.mark.slow
@pytest.mark.every_vllm
def test_a_served_engine_without_dev_mode_answers_nobody_without_the_key(keyed) -> None:
    """No key or a wrong one: ``401`` on the bridge's results and pause routes, vLLM's RL
    routes and its completions; with the key, vLLM's RL routes are not served (``404``: no dev
    mode) and the results route answers; the health probe needs no key."""
    url = keyed.url
    for key in (None, "wrong"):
        assert _status(url + RESULTS_ROUTE, "GET", key) == 401, key
        assert _status(url + PAUSE_ROUTE + "?mode=wait", "POST", key) == 401, key
        for route in ("/pause", "/resume", "/update_weights", "/v1/completions"):
            assert _status(url + route, "POST", key) == 401, (route, key)
    assert _status(url + RESULTS_ROUTE, "GET", KEY) == 200
    for route in ("/pause", "/resume", "/update_weights", "/start_weight_update"):
        assert _status(url + route, "POST", KEY) == 404, route
    assert _status(url + "/health", "GET", None) == 200


@pytest.mark.slow
@pytest.mark.every_vllm
def test_a_served_pause_no_update_follows_is_released_after_the_update_timeout(keyed) -> None:
    """The bridge's pause, with the key, on a server where vLLM serves no ``/resume``: a
    completion sent meanwhile waits (queued), and runs once the pause is released after the
    engine's ``update_timeout_s``, with the warning in the server's log."""
    url = keyed.url
    models = urllib.request.Request(url + "/v1/models", headers=_bearer(KEY))
    with urllib.request.urlopen(models, timeout=30) as answer:
        model = json.loads(answer.read())["data"][0]["id"]
    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 2}
    assert _status(url + "/v1/completions", "POST", KEY, body) == 200  # warm: not paused
    paused_at = time.monotonic()
    assert _status(url + PAUSE_ROUTE + "?mode=wait", "POST", KEY) == 200
    done: dict = {}

    def complete() -> None:
        done["status"] = _status(url + "/v1/completions", "POST", KEY, body)
        done["at"] = time.monotonic()

    thread = threading.Thread(target=complete, daemon=True)
    thread.start()
    thread.join(RELEASE_S + 90)
    assert done.get("status") == 200, f"the completion never ran: {done}\n{keyed.tail()}"
    assert done["at"] - paused_at >= RELEASE_S - 0.5, "the pause did not hold"
    assert "no update followed" in keyed.log.read_text(errors="replace")
