"""The one client protocol, and the one push routine every client of a bridged engine runs.

A push is vLLM's own three calls, ``start_weight_update`` -> ``update_weights({"checkpoint":
PATH})`` -> ``finish_weight_update(weight_version=V)``, each update a transaction in the engine
(:mod:`~weight_bridge.vllm.worker.backend`). Where the engine's workers run in this process,
the checkpoint may be tensors in memory (a :class:`~weight_bridge.checkpoint.live.LiveCheckpoint`:
the object itself goes in ``update_info``); a client of another process refuses one by name,
before anything starts. Where the engine generates concurrently (``AsyncLLM``,
``vllm serve``), a push can happen *in flight*, inside ``pause_generation`` ...
``resume_generation``:

* ``"recompute"``: running requests are preempted before the update and recompute their KV
  with the new weights on resume: their tokens after the update are what the new policy
  continues the whole prefix with (vLLM's ``pause_generation(mode="keep", clear_cache=True)``);
* ``"keep"``: running requests keep the KV the old weights computed (PipelineRL's semantics);
  no request that arrives later reuses it (``mode="keep", clear_cache=False``);
* ``"drain"``: running requests finish first, new ones wait (``mode="wait"``). Since vLLM 0.33
  ``pause_generation(mode="wait")`` rejects the new ones (HTTP 503) instead, so ``AsyncLLM``
  pauses its scheduler itself (:func:`~weight_bridge.vllm.internals.pause.pause_queueing`, which
  queues them, as 0.32 did) and ``HTTPClient`` sends a rejected generate request again until
  generation resumes (a bound: its ``timeout_s``): on every vLLM no request fails.

A refused or failed update resumes generation on the version served before; nothing in flight
is lost. Every finished output's ``weight_versions`` spans name the weights that computed its
tokens, in every mode (``None`` included): the engine core stamps the version with the write
(:mod:`~weight_bridge.vllm.core.updates`; by default :func:`weight_bridge.checkpoint.version_of`).

One update at a time: a push that meets another update in progress raises
:class:`~weight_bridge.vllm.errors.UpdateInProgressError` (``409 Conflict`` over HTTP) before it
pauses anything, so it never resumes generation another update paused: each push takes the engine's
update (``start_weight_update``) *before* it pauses, and resumes only what it paused.

The report (:class:`~weight_bridge.vllm.report.PushReport`), the served chain and the errors come
from the engine's own answer, the push's report as the engine core built it once
(:mod:`~weight_bridge.vllm.report`): the same in every client.

This module imports no vLLM: a trainer that only pushes into a server needs none.
"""

from __future__ import annotations

import abc
import concurrent.futures
import contextlib
import os
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from ...checkpoint.errors import CheckpointError
from ...checkpoint.live import LiveCheckpoint
from ..generation import Generation
from ..options import OptionError
from ..report import PushReport, report_of

Checkpoint = str | os.PathLike | LiveCheckpoint  # a file or a directory, or tensors in memory
InflightMode = Literal["recompute", "keep", "drain"]
INFLIGHT_MODES = ("recompute", "keep", "drain")
# in-flight mode -> vLLM's pause_generation(mode, clear_cache)
_PAUSE: dict[str, tuple[str, bool]] = {
    "recompute": ("keep", True),
    "keep": ("keep", False),
    "drain": ("wait", False),
}


@runtime_checkable
class EngineClient(Protocol):
    """What every client and engine of the bridge offers (and what the callback uses)."""

    def push(
        self, checkpoint: Checkpoint, version: Any = None, verify_hash: bool | None = None
    ) -> PushReport: ...

    def generate(
        self, prompts: Sequence[Any], sampling: Any = None, version: Any = None
    ) -> list[Generation]: ...

    def submit(
        self, prompts: Sequence[Any], sampling: Any = None, version: Any = None
    ) -> concurrent.futures.Future[list[Generation]]: ...

    @property
    def version(self) -> Any: ...

    @property
    def served_checkpoints(self) -> list[str]: ...

    def close(self) -> None: ...


def check_inflight(inflight: str | None) -> None:
    """Refuse an unknown in-flight mode by name (before any engine starts, where it can)."""
    if inflight is not None and inflight not in _PAUSE:
        raise OptionError(f"inflight must be one of {INFLIGHT_MODES} or None, not {inflight!r}")


def run_blocking(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """The result of a coroutine whose awaits all complete at once (a blocking client's
    calls): no event loop, so it works on any thread, a loop's included."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("a blocking client's call suspended")


class BridgeClient(abc.ABC):
    """The one push routine (:meth:`push_async`) over the engine's own calls, which each client
    provides (``_start``, ``_pause``, ``_update``, ``_finish``, ``_resume``, ``_report``),
    and the report, the label and the served chain from the engine's answer: the push's
    report as the engine core built it, fetched once (after a refusal or failure, the typed
    error carries it: :func:`~weight_bridge.vllm.report.report_of`).

    ``inflight``: the default in-flight mode (None: push without pausing generation; the update
    then lands between two steps, with ``"keep"``'s semantics for requests running then).
    """

    pauses = True  # whether the engine can pause generation for an in-flight push
    takes_adapters = False  # whether the engine has LoRA slots an adapter push writes into

    def __init__(self, inflight: InflightMode | None = None) -> None:
        check_inflight(inflight)
        self.inflight = inflight
        self.version: Any = None  # the version pushed last (None: none yet)
        self.last_report: PushReport | None = None
        self.last_rollback_s: float | None = None
        self._served: list[str] = []

    @property
    def in_process(self) -> bool:
        """Whether the engine's workers run in this process: only they take tensors in memory
        (the object crosses as it is; to another process nothing of it could)."""
        return False

    @property
    def served_checkpoints(self) -> list[str]:
        """What the served version is made of, as the engine's workers answered: its complete
        checkpoint, then each partial one pushed on top of it (all needed to roll back)."""
        return list(self._served)

    @property
    def checkpoint(self) -> str | None:
        """The checkpoint pushed last (after partial pushes, the last partial one)."""
        return self._served[-1] if self._served else None

    def push(
        self,
        checkpoint: Checkpoint,
        version: Any = None,
        verify_hash: bool | None = None,
        check_finite: bool | None = None,
        inflight: InflightMode | None | Literal["default"] = "default",
    ) -> PushReport:
        """:meth:`push_async`, from the caller's thread; blocks until the push ended (in
        flight: until generation resumed)."""
        self._check_source(checkpoint)  # before the client asks anything of the engine
        return self._blocking(
            self.push_async(checkpoint, version, verify_hash, check_finite, inflight)
        )

    @abc.abstractmethod
    def _blocking(self, push: Coroutine[Any, Any, PushReport]) -> PushReport:
        """Run ``push`` to its end from the caller's thread (each client knows where)."""

    async def push_async(
        self,
        checkpoint: Checkpoint,
        version: Any = None,
        verify_hash: bool | None = None,
        check_finite: bool | None = None,
        inflight: InflightMode | None | Literal["default"] = "default",
    ) -> PushReport:
        """Write ``checkpoint`` (a safetensors file or a directory of shards; tensors in memory
        where :attr:`in_process`) into the engine; a refusal (nothing written) or a failure
        (rolled back) raises the project's error, naming each tensor. ``version`` defaults to
        the engine's rule; ``verify_hash`` and ``check_finite`` to the engine's options;
        ``inflight`` to this client's mode.

        A *partial* checkpoint (metadata ``base_version``, see
        :data:`~weight_bridge.checkpoint.BASE_VERSION_KEY`) holds a subset of the tensors and is
        written only when the engine serves exactly that base version; otherwise it is refused,
        naming both versions, before anything is written. It is written directly (never by
        vLLM's layerwise path), and only the modules it writes into are refreshed."""
        mode = self.inflight if inflight == "default" else inflight
        check_inflight(mode)
        if mode is not None and not self.pauses:
            raise ValueError(f"{type(self).__name__} pushes without pausing: inflight must be None")
        self._check_source(checkpoint)
        info = _update_info(checkpoint, version, verify_hash, check_finite)
        started = time.perf_counter()
        await self._start()  # refused (UpdateInProgressError) before anything is paused
        paused = None
        sent = False
        try:
            if mode is not None:
                paused = time.perf_counter()
                await self._pause(*_PAUSE[mode])
            sent = True
            try:
                await self._update(info)  # a refusal or failure ends the update in the engine
            except BaseException as exc:
                await self._failed(exc)
                raise
            await self._finish(info.get("version"))
        finally:
            if not sent:
                await self._end_unsent()
            if paused is not None:
                await self._resume()
                paused = time.perf_counter() - paused
        report = await self._report()
        if report is None or not report.results:
            raise RuntimeError("the engine answered no report of the update it acknowledged")
        report.version = version if version is not None else report.version
        report.elapsed_s = time.perf_counter() - started
        report.paused_s, report.inflight = paused, mode
        self._pushed(report)
        return report

    def _check_source(self, checkpoint: Checkpoint) -> None:
        """Tensors in memory are refused by name where the engine runs in another process."""
        if isinstance(checkpoint, LiveCheckpoint) and not self.in_process:
            raise CheckpointError(
                checkpoint.path,
                f"{type(self).__name__}'s engine runs in another process: tensors in memory are "
                "pushed only into an engine whose workers run in the trainer's process",
            )

    def _pushed(self, report: PushReport) -> None:
        """What a client remembers of a successful push."""
        self._served, self.version, self.last_report = list(report.served), report.version, report

    async def _failed(self, error: BaseException) -> None:
        """After a refused or failed update: what the engine answered about it (the report
        the typed error carries; else, for an error that is no outcome of the update, fetched)."""
        report = report_of(error)
        if report is None:
            with contextlib.suppress(Exception):
                report = await self._report()
        if report is not None:
            self._note_failure(report)

    def _note_failure(self, report: PushReport) -> None:
        """The served chain and the rollback's time after a refused or failed update (a client
        that can tell more about the engine's state adds to this)."""
        results = report.results
        if results:
            self._served = list(results[0].served)
        self.last_rollback_s = max(
            (r.rollback_s for r in results if r.rollback_s is not None), default=None
        )

    async def _end_unsent(self) -> None:
        """A pause that failed (or was interrupted) after this push took the engine's update:
        end it, so the next push can start. (An update that was sent and refused or failed is
        ended by the engine itself: a finish then could end another pusher's update.)"""
        with contextlib.suppress(Exception):
            await self._finish(None)

    async def _pause(self, mode: str, clear_cache: bool) -> None:
        raise NotImplementedError  # a client with pauses = False is never asked

    async def _resume(self) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    async def _start(self) -> None: ...

    @abc.abstractmethod
    async def _update(self, info: dict) -> None: ...

    @abc.abstractmethod
    async def _finish(self, version: str | None) -> None: ...

    @abc.abstractmethod
    async def _report(self) -> PushReport | None:
        """The last update's report, as the engine core built it (None: none yet)."""

    @abc.abstractmethod
    def submit(
        self, prompts: Sequence[Any], sampling: Any = None, version: Any = None
    ) -> concurrent.futures.Future[list[Generation]]:
        """Start generating ``prompts`` (each a list of token ids, ``{"prompt_token_ids":
        [...]}``, or text where the client tokenizes) with ``sampling`` (a dict of vLLM's
        sampling parameters; in process also a ``vllm.SamplingParams``); the future's result
        is one :class:`~weight_bridge.vllm.generation.Generation` per prompt, in order. In an
        engine holding adapter versions in its LoRA slots, the newest samples, or ``version``
        (one that is not resident: :class:`~weight_bridge.vllm.errors.AdapterVersionError`)."""

    def generate(
        self, prompts: Sequence[Any], sampling: Any = None, version: Any = None
    ) -> list[Generation]:
        """:meth:`submit` and wait: one
        :class:`~weight_bridge.vllm.generation.Generation` per prompt, the same from every
        client."""
        return self.submit(prompts, sampling, version).result()

    def close(self) -> None:  # noqa: B027 (a default, not an abstract method)
        """A client of an engine it did not start closes nothing (an engine it owns does)."""

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _update_info(
    checkpoint: Checkpoint, version: Any, verify_hash: bool | None, check: bool | None
) -> dict[str, Any]:
    """``update_info``: the version goes with the write (the engine stamps it in the same
    step), not only with ``finish_weight_update``. Tensors in memory go as they are."""
    where = (
        checkpoint if isinstance(checkpoint, LiveCheckpoint) else str(Path(checkpoint).resolve())
    )
    info: dict[str, Any] = {"checkpoint": where}
    if version is not None:
        info["version"] = str(version)
    if verify_hash is not None:
        info["verify_hash"] = verify_hash
    if check is not None:
        info["check_finite"] = check
    return info
