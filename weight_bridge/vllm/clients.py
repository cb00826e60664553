"""Clients of vLLM's RL update API for a bridged engine, one per way of running vLLM.

A push is vLLM's own three calls, ``start_weight_update`` -> ``update_weights({"checkpoint":
PATH})`` -> ``finish_weight_update(weight_version=V)``, each update a transaction in the engine
(:mod:`.backend`). Where the engine generates concurrently (``AsyncLLM``, ``vllm serve``), a push
can happen *in flight*, inside ``pause_generation`` ... ``resume_generation``:

* ``"recompute"``: running requests are preempted before the update and recompute their KV
  with the new weights on resume: their tokens after the update are what the new policy
  continues the whole prefix with (vLLM's ``pause_generation(mode="keep", clear_cache=True)``);
* ``"keep"``: running requests keep the KV the old weights computed (PipelineRL's semantics);
  no request that arrives later reuses it (``mode="keep", clear_cache=False``);
* ``"drain"``: running requests finish first, new ones wait (``mode="wait"``).

A refused or failed update resumes generation on the version served before; nothing in flight
is lost. Every finished output carries vLLM's ``weight_versions`` spans, and each span names the
weights that computed its tokens, in every mode (``None`` included): the engine core stamps the
new version in the same call that writes the weights (:mod:`.core_hooks`). A push's version
defaults to the checkpoint's ``version`` metadata, else its file name (the engine's rule, the
same for every client). The report says how long generation was paused (``paused_s``).

One update at a time: a push that meets another update in progress raises
:class:`~.results.UpdateInProgressError` (``409 Conflict`` over HTTP) before it pauses anything,
so it never resumes generation another update paused: each push takes the engine's update
(``start_weight_update``) *before* it pauses, and resumes only what it paused.

* :class:`LLMClient`: a ``vllm.LLM`` in this process (no concurrent generation, no in-flight).
* :class:`AsyncLLMClient`: an ``AsyncLLM`` in this process, from its event loop or another
  thread.
* :class:`HTTPClient`: a ``vllm serve`` process (``VLLM_SERVER_DEV_MODE=1``), stdlib only, so a
  trainer needs no vLLM to push into one.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import os
import time
import urllib.error
import urllib.request
from http import HTTPStatus
from pathlib import Path
from typing import Any, Literal

from .results import PushReport, PushResult, UpdateInProgressError

__all__ = [
    "INFLIGHT_MODES",
    "AsyncLLMClient",
    "HTTPClient",
    "InflightMode",
    "LLMClient",
    "RemoteUpdateError",
    "ServedChain",
]

InflightMode = Literal["recompute", "keep", "drain"]
INFLIGHT_MODES = ("recompute", "keep", "drain")
# in-flight mode -> vLLM's pause_generation(mode, clear_cache)
_PAUSE: dict[str, tuple[str, bool]] = {
    "recompute": ("keep", True),
    "keep": ("keep", False),
    "drain": ("wait", False),
}


def _check_inflight(inflight: str | None) -> None:
    if inflight is not None and inflight not in _PAUSE:
        raise ValueError(f"inflight must be one of {INFLIGHT_MODES} or None, not {inflight!r}")


def _request(
    checkpoint: str | os.PathLike, version: Any, verify_hash: bool | None
) -> tuple[str, dict]:
    """The path and ``update_info``: the version goes with the write (the engine stamps it in
    the same step), not only with ``finish_weight_update``."""
    path = str(Path(checkpoint).resolve())
    info: dict[str, Any] = {"checkpoint": path}
    if version is not None:
        info["version"] = str(version)
    if verify_hash is not None:
        info["verify_hash"] = verify_hash
    return path, info


class ServedChain:
    """The checkpoints the engine serves, as the pushes of this client made them: a complete
    checkpoint, then partial ones on top of it (a failed push leaves it as it was)."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.version: Any = None

    def served(self, path: str, version: Any, partial: bool) -> None:
        self.paths = [*self.paths, path] if partial else [path]
        self.version = version

    @property
    def served_checkpoints(self) -> list[str]:
        return list(self.paths)


def _is_partial(path: str) -> bool:
    from ..checkpoint import BASE_VERSION_KEY, CheckpointReader

    with CheckpointReader(path) as reader:
        return BASE_VERSION_KEY in reader.metadata


def _report(results: list[PushResult], version: Any, started: float) -> PushReport:
    report = PushReport.merged(results, version)
    report.elapsed_s = time.perf_counter() - started
    return report


class LLMClient(ServedChain):
    """Pushes into a ``vllm.LLM`` started with ``weight_transfer_config={"backend":
    "weight_bridge"}``; errors are the project's own (typed by the plugin)."""

    def __init__(self, llm: Any) -> None:
        super().__init__()
        self.llm = llm

    def push(
        self, checkpoint: str | os.PathLike, version: Any = None, verify_hash: bool | None = None
    ) -> PushReport:
        from .api_hooks import update_results

        path, info = _request(checkpoint, version, verify_hash)
        started = time.perf_counter()
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": info})
        self.llm.finish_weight_update(weight_version=info.get("version"))
        results = update_results(self.llm.llm_engine.engine_core)
        version = self.llm.get_weight_version() if version is None else version
        self.served(path, version, results[0].partial)
        return _report(results, version, started)

    def generate(self, prompts: Any, sampling_params: Any = None, **kwargs: Any) -> list[Any]:
        return self.llm.generate(prompts, sampling_params, use_tqdm=False, **kwargs)

    def close(self) -> None:
        """The ``LLM`` is the caller's: nothing to close."""


class _InflightClient(ServedChain, abc.ABC):
    """What an engine that generates while it is pushed shares: the default in-flight mode and
    the one push routine (:meth:`_push`) over the engine's own five calls, which each client
    provides (``_pause``, ``_start``, ``_update``, ``_finish``, ``_resume``)."""

    def __init__(self, inflight: InflightMode | None) -> None:
        super().__init__()
        _check_inflight(inflight)
        self.inflight = inflight

    async def _push(
        self, checkpoint: str | os.PathLike, version: Any, verify_hash: bool | None, inflight: Any
    ) -> tuple[str, Any, float | None, str | None]:
        """vLLM's three weight-update calls, inside pause ... resume when in flight (a failed
        update resumes generation on the version served before); the path, the version, how
        long generation was paused (from the pause's request on: a drain's wait included; None
        if not paused) and the mode."""
        mode = self.inflight if inflight == "default" else inflight
        _check_inflight(mode)
        path, info = _request(checkpoint, version, verify_hash)
        await self._start()  # refused (UpdateInProgressError) before anything is paused
        paused = None
        sent = False
        try:
            if mode is not None:
                paused = time.perf_counter()
                await self._pause(*_PAUSE[mode])
            sent = True
            await self._update(info)  # a refusal or failure ends the update in the engine
            await self._finish(info.get("version"))
        finally:
            if not sent:
                await self._end_unsent()
            if paused is not None:
                await self._resume()
                paused = time.perf_counter() - paused
        if version is None:
            version = await self._version()
        return path, version, paused, mode

    async def _end_unsent(self) -> None:
        """A pause that failed (or was interrupted) after this push took the engine's update:
        end it, so the next push can start. (An update that was sent and refused or failed is
        ended by the engine itself: a finish then could end another pusher's update.)"""
        with contextlib.suppress(Exception):
            await self._finish(None)

    @abc.abstractmethod
    async def _pause(self, mode: str, clear_cache: bool) -> None: ...

    @abc.abstractmethod
    async def _start(self) -> None: ...

    @abc.abstractmethod
    async def _update(self, info: dict) -> None: ...

    @abc.abstractmethod
    async def _finish(self, version: str | None) -> None: ...

    @abc.abstractmethod
    async def _resume(self) -> None: ...

    @abc.abstractmethod
    async def _version(self) -> str: ...


class AsyncLLMClient(_InflightClient):
    """Pushes into an ``AsyncLLM`` started with the backend, in flight if asked.

    ``loop``: the event loop the engine runs on, for :meth:`push` from another thread (a
    trainer's); in that loop itself, await :meth:`push_async`. ``inflight``: the default mode
    (None: push without pausing generation; the update then lands between two steps, with
    ``"keep"``'s semantics for requests running at that moment).
    """

    def __init__(
        self,
        engine: Any,
        loop: asyncio.AbstractEventLoop | None = None,
        inflight: InflightMode | None = "recompute",
    ) -> None:
        super().__init__(inflight)
        self.engine = engine
        self.loop = loop

    async def push_async(
        self,
        checkpoint: str | os.PathLike,
        version: Any = None,
        verify_hash: bool | None = None,
        inflight: InflightMode | None | Literal["default"] = "default",
    ) -> PushReport:
        from .api_hooks import update_results_async

        started = time.perf_counter()
        path, version, paused, mode = await self._push(checkpoint, version, verify_hash, inflight)
        results = await update_results_async(self.engine.engine_core)
        self.served(path, version, results[0].partial)
        report = _report(results, version, started)
        report.paused_s, report.inflight = paused, mode
        return report

    def push(
        self,
        checkpoint: str | os.PathLike,
        version: Any = None,
        verify_hash: bool | None = None,
        inflight: InflightMode | None | Literal["default"] = "default",
    ) -> PushReport:
        """:meth:`push_async` run on the engine's loop, from another thread; blocks."""
        if self.loop is None:
            raise RuntimeError("AsyncLLMClient.push from another thread needs loop=")
        coroutine = self.push_async(checkpoint, version, verify_hash, inflight)
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    async def _pause(self, mode: str, clear_cache: bool) -> None:
        await self.engine.pause_generation(mode=mode, clear_cache=clear_cache)

    async def _start(self) -> None:
        await self.engine.start_weight_update()

    async def _update(self, info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self.engine.update_weights(WeightTransferUpdateRequest(update_info=info))

    async def _finish(self, version: str | None) -> None:
        await self.engine.finish_weight_update(version)

    async def _resume(self) -> None:
        await self.engine.resume_generation()

    async def _version(self) -> str:
        return str(await self.engine.get_weight_version())

    def close(self) -> None:
        """The ``AsyncLLM`` is the caller's: nothing to close."""


class RemoteUpdateError(RuntimeError):
    """A ``vllm serve`` engine refused or failed an update: the HTTP status and the server's
    message, which names each tensor and says what the engine serves now."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class HTTPClient(_InflightClient):
    """Pushes into a ``vllm serve`` process over its RL routes, in flight if asked.

    ``url``: the server's base URL; ``api_key``: its key (default ``$VLLM_API_KEY``; see
    :mod:`~weight_bridge.vllm.server_auth`: vLLM's own ``--api-key`` does not guard the RL
    routes); ``inflight``: the default mode (None: no pause). Blocking calls, from a thread
    without a running event loop (a trainer's).
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
            raise RemoteUpdateError(exc.code, message) from None
        return json.loads(raw) if raw else None

    def weight_version(self) -> str:
        """The version the server stamps on outputs (``GET /weight_info``)."""
        return str(self.call("weight_info", method="GET")["weight_version"])

    def push(
        self,
        checkpoint: str | os.PathLike,
        version: Any = None,
        verify_hash: bool | None = None,
        inflight: InflightMode | None | Literal["default"] = "default",
    ) -> PushReport:
        started = time.perf_counter()
        pushed = self._push(checkpoint, version, verify_hash, inflight)
        path, version, paused, mode = asyncio.run(pushed)  # each call blocks: no loop needed
        self.served(path, version, _is_partial(path))
        report = PushReport(checkpoint=path, version=version, mode="remote")
        report.elapsed_s = time.perf_counter() - started
        report.paused_s, report.inflight = paused, mode
        return report

    async def _pause(self, mode: str, clear_cache: bool) -> None:
        self.call(f"pause?mode={mode}&clear_cache={str(clear_cache).lower()}")

    async def _start(self) -> None:
        self.call("start_weight_update")

    async def _update(self, info: dict) -> None:
        self.call("update_weights", {"update_info": info})

    async def _finish(self, version: str | None) -> None:
        self.call("finish_weight_update", {"weight_version": version} if version else {})

    async def _resume(self) -> None:
        self.call("resume")

    async def _version(self) -> str:
        return self.weight_version()

    def generate_tokens(self, token_ids: list[int], sampling_params: dict) -> list[dict]:
        """Completions of one prompt given as token ids (``POST /inference/v1/generate``; the
        server needs ``--enable-scale-out``): its choices (``sampling_params["n"]`` of them),
        each with ``token_ids``, ``logprobs`` and ``weight_versions``."""
        body = {"token_ids": list(token_ids), "sampling_params": dict(sampling_params)}
        return list(self.call("inference/v1/generate", body)["choices"])

    def close(self) -> None:
        """The server is not this client's: nothing to close."""


def _message(raw: bytes) -> str:
    try:
        body = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    return json.dumps(body)
