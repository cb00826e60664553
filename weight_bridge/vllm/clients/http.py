"""The client of a ``vllm serve`` process running the ``weight_bridge`` backend, over HTTP.

Stdlib only, so a trainer needs no vLLM to push into a server. It runs the one push routine
(:mod:`~weight_bridge.vllm.clients.bridge_client`) over vLLM's RL routes
(``VLLM_SERVER_DEV_MODE=1``), in flight if asked, and reads every worker's result of the update from
the bridge's ``GET /weight_bridge/results`` route
(:func:`~weight_bridge.vllm.server.middleware.update_results_route`, which a server started by
:class:`~weight_bridge.vllm.clients.served.VLLMServer` has; a server started by hand needs
``--middleware weight_bridge.vllm.server.middleware.update_results_route``, and a push into one
without it is refused before it starts, naming that flag).

Generation asks vLLM 0.33+ (read once from ``GET /version``) through OpenAI's ``/v1/completions``
with ``return_weight_versions``, which labels every token without ``--enable-scale-out``; an older
server through the token-in/token-out route ``/inference/v1/generate``, which needs that flag. Both
give the same :class:`~weight_bridge.vllm.generation.Generation`, and name the server's model:
the served name (the newest adapter version resident, else the base) or ``NAME@VERSION`` (a
resident version; ``NAME@base``: the base), as the results middleware serves them. A ``drain``
push pauses through the bridge's route, which queues the requests that arrive meanwhile, so no
client of the server sees a failure; a generate request the server answers ``503`` all the same
(vLLM 0.33+ rejects requests while another pauser's ``/pause?mode=wait`` holds generation) is
sent again until generation resumes, for at most ``timeout_s``: it waits for the push, as in
process.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Coroutine, Sequence
from http import HTTPStatus
from typing import Any

from ...errors import WeightBridgeError
from ..core.adapters import chosen_adapter
from ..errors import UNDEFINED, EngineUndefinedError, UpdateInProgressError
from ..generation import Generation, prompt_token_ids
from ..internals.versions import vllm_minor
from ..options import BACKEND_RPC
from ..report import PushReport, typed_error
from ..server.middleware import MODELS_ROUTE, PAUSE_ROUTE, RESULTS_ROUTE, served_version_name
from .bridge_client import BridgeClient, InflightMode, run_blocking

_GENERATE_THREADS = 16  # concurrent generate requests of one client (the engine batches them)
_DEFAULT_MAX_TOKENS = 16  # vllm.SamplingParams' default: the server would fill to the model length
_WEIGHT_VERSIONS_SINCE = (0, 33)  # the first vLLM whose /v1/completions returns weight_versions
_RETRY_FIRST_S, _RETRY_MOST_S = 0.02, 0.5  # a rejected generate request is sent again this often


class RemoteUpdateError(WeightBridgeError, RuntimeError):
    """A non-2xx answer of a server that is no outcome of a bridged update (a route missing, a
    request unauthorized, a server that is not bridged...): the HTTP status and the server's
    message. A bridged engine's refusal or failure of an update is raised as the same typed
    error as in process (:class:`~weight_bridge.direct.DirectReloadError`,
    :class:`~weight_bridge.checkpoint.CheckpointError`, with ``.problems``), this error its
    ``__cause__``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class HTTPClient(BridgeClient):
    """Pushes into a ``vllm serve`` process over its RL routes, in flight if asked.

    ``url``: the server's base URL; ``api_key``: its key (default ``$VLLM_API_KEY``; see
    :mod:`~weight_bridge.vllm.server.middleware`: vLLM's own ``--api-key`` does not guard the
    RL routes); ``inflight``: the default mode (None: no pause). Blocking calls, from any
    thread. The server is not this client's: :meth:`close` leaves it running.
    """

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        timeout_s: float = 300.0,
        inflight: InflightMode | None = "recompute",
    ) -> None:
        super().__init__(inflight)
        self.url = url.rstrip("/")
        self.api_key = api_key or os.environ.get("VLLM_API_KEY") or None
        self.timeout_s = timeout_s
        self._has_results_route = False
        self._completions: bool | None = None  # generate through /v1/completions (None: unknown)
        self._model: str | None = None  # the model name the server serves (None: not asked)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def call(self, route: str, body: Any = None, method: str = "POST") -> Any:
        """One request to the server; its JSON answer, or :class:`RemoteUpdateError`."""
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"{self.url}/{route.lstrip('/')}", data, method=method)
        request.add_header("Content-Type", "application/json")
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            message = _message(exc.read())
            if exc.code == HTTPStatus.CONFLICT:
                raise UpdateInProgressError(message) from None
            if exc.code == HTTPStatus.SERVICE_UNAVAILABLE and UNDEFINED in message:
                raise EngineUndefinedError(message) from None  # the results middleware's answer
            raise RemoteUpdateError(exc.code, message) from None
        return json.loads(raw) if raw else None

    def weight_version(self) -> str:
        """The version the server stamps on outputs (``GET /weight_info``)."""
        return str(self.call("weight_info", method="GET")["weight_version"])

    def _blocking(self, push: Coroutine[Any, Any, PushReport]) -> PushReport:
        if not self._has_results_route:
            try:
                self._check_results_route()
            except BaseException:
                push.close()
                raise
        return run_blocking(push)

    def _check_results_route(self) -> None:
        try:
            self.call(RESULTS_ROUTE, method="GET")
        except RemoteUpdateError as exc:
            if exc.status != HTTPStatus.NOT_FOUND:
                raise
            raise RemoteUpdateError(
                exc.status,
                f"{self.url} has no {RESULTS_ROUTE} route, so a push could not report what "
                "it wrote: start the server with --middleware "
                "weight_bridge.vllm.server.middleware.update_results_route (nothing was pushed)",
            ) from None
        self._has_results_route = True

    async def _pause(self, mode: str, clear_cache: bool) -> None:
        """``drain`` (``mode="wait"``) through the bridge's pause route, which queues the
        requests that arrive meanwhile (vLLM 0.33+'s ``/pause?mode=wait`` answers every other
        client 503 until resume); the other modes through vLLM's ``/pause``."""
        route = PAUSE_ROUTE if mode == "wait" else "pause"
        self.call(f"{route}?mode={mode}&clear_cache={str(clear_cache).lower()}")

    async def _start(self) -> None:
        self.call("start_weight_update")

    async def _update(self, info: dict) -> None:
        try:
            self.call("update_weights", {"update_info": info})
        except RemoteUpdateError as answer:
            error = self._refusal(answer)
            if error is None:
                raise
            raise error from answer

    def _refusal(self, answer: RemoteUpdateError) -> BaseException | None:
        """A bridged server's refusal or failure of the update: the typed error the engine
        core's report makes (fetched once, from the results route), as in process."""
        if not self._has_results_route or answer.status == HTTPStatus.UNAUTHORIZED:
            return None
        try:
            report = PushReport.from_dict(self.call(RESULTS_ROUTE, method="GET"))
        except Exception:
            return None
        return typed_error(report)

    async def _finish(self, version: str | None) -> None:
        self.call("finish_weight_update", {"weight_version": version} if version else {})

    async def _resume(self) -> None:
        self.call("resume")

    def fingerprints(self) -> list[dict[str, str]]:
        """:meth:`LLMClient.fingerprints <weight_bridge.vllm.clients.llm.LLMClient.fingerprints>`
        through vLLM's ``/collective_rpc`` development route (``VLLM_SERVER_DEV_MODE=1``)."""
        answer = self.call("collective_rpc", {"method": BACKEND_RPC, "args": ["fingerprints"]})
        return list(answer["results"])

    async def _report(self) -> PushReport | None:
        return PushReport.from_dict(self.call(RESULTS_ROUTE, method="GET"))

    # -- generation --------------------------------------------------------------------------

    def submit(
        self, prompts: Sequence[Any], sampling: Any = None, version: Any = None
    ) -> concurrent.futures.Future[list[Generation]]:
        """:meth:`BridgeClient.submit <.bridge_client.BridgeClient.submit>` for token ids only
        (``max_tokens`` defaults to 16, as in process), one request per prompt
        (``/v1/completions`` on vLLM 0.33+, else ``/inference/v1/generate``, which needs
        ``--enable-scale-out``) on a small thread pool. Each request names the server's model:
        the served name (the newest adapter version, else the base), or ``NAME@VERSION``
        (:mod:`~weight_bridge.vllm.server.middleware`); a version the server does not hold is
        refused by name (:class:`~weight_bridge.vllm.errors.AdapterVersionError`)."""
        if sampling is not None and not isinstance(sampling, dict):
            raise TypeError(
                f"{type(self).__name__} takes sampling as a dict of vLLM's sampling parameters, "
                f"not {type(sampling).__name__}"
            )
        params = {"max_tokens": _DEFAULT_MAX_TOKENS, **(sampling or {})}
        ids = [prompt_token_ids(p) for p in prompts]
        with self._pool_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    _GENERATE_THREADS, "weight-bridge-http"
                )
            futures = [self._pool.submit(self._generate_one, p, params, version) for p in ids]
        return _gathered(futures)

    def _generate_one(self, token_ids: list[int], sampling: dict, version: Any) -> Generation:
        if self._completions is None:
            self._completions = self._labels_completions()
        if self._model is None:  # the first card of vLLM's list: its first served name
            self._model = str(self.call(MODELS_ROUTE, method="GET")["data"][0]["id"])
        model = self._model if version is None else served_version_name(self._model, str(version))
        try:
            if self._completions:
                body = {"model": model, "prompt": token_ids, **sampling, **_LABELLED}
                answer = self._until_served("v1/completions", body)
                return Generation.from_completion_json(
                    answer, token_ids, sampling.get("logprobs"), self.version
                )
            body = {"model": model, "token_ids": token_ids, "sampling_params": sampling}
            answer = self._until_served("inference/v1/generate", body)
            return Generation.from_json(answer, token_ids, self.version)
        except RemoteUpdateError as exc:
            if version is not None and exc.status == HTTPStatus.NOT_FOUND:
                # an unknown model: refused by name, with what the engine holds
                report = self.call(RESULTS_ROUTE, method="GET") or {}
                chosen_adapter(report.get("adapters") or {}, version)
            raise

    def _labels_completions(self) -> bool:
        """Whether the server's ``/v1/completions`` takes ``return_weight_versions`` (vLLM
        0.33+): then generation needs no ``--enable-scale-out``."""
        version = str(self.call("version", method="GET").get("version", ""))
        return vllm_minor(version or "unknown") >= _WEIGHT_VERSIONS_SINCE

    def _until_served(self, route: str, body: dict) -> Any:
        """One generate request, sent again while the server answers 503 (paused, or
        overloaded: it did not take the request), for at most ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        wait = _RETRY_FIRST_S
        while True:
            try:
                return self.call(route, body)
            except RemoteUpdateError as exc:
                if exc.status != HTTPStatus.SERVICE_UNAVAILABLE:
                    raise
                if time.monotonic() + wait > deadline:
                    raise RemoteUpdateError(
                        exc.status,
                        f"{self.url} rejected a generate request for timeout_s={self.timeout_s} "
                        f"s (generation never resumed; a push that paused it and died?): "
                        f"{exc.message}",
                    ) from None
            time.sleep(wait)
            wait = min(2 * wait, _RETRY_MOST_S)

    def close(self) -> None:
        """Stop this client's generation threads (the server keeps running)."""
        pool, self._pool = getattr(self, "_pool", None), None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


# what /v1/completions must return for a Generation: token ids and the weights behind each token
_LABELLED = {
    "return_token_ids": True,
    "return_tokens_as_token_ids": True,
    "return_weight_versions": True,
}


def _gathered(
    futures: list[concurrent.futures.Future[Generation]],
) -> concurrent.futures.Future[list[Generation]]:
    """One future of every result of ``futures``, in order (the first error, if any)."""
    out: concurrent.futures.Future[list[Generation]] = concurrent.futures.Future()
    left = [len(futures)]
    lock = threading.Lock()

    def done(_: Any) -> None:
        with lock:
            left[0] -= 1
            if left[0] > 0:
                return
        if not out.set_running_or_notify_cancel():
            return
        try:
            out.set_result([f.result() for f in futures])
        except BaseException as exc:
            out.set_exception(exc)

    if not futures:
        out.set_result([])
    for future in futures:
        future.add_done_callback(done)
    return out


def _message(raw: bytes) -> str:
    try:
        body = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    return json.dumps(body)
