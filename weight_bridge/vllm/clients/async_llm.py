"""The client of an ``AsyncLLM`` started with the ``weight_bridge`` backend: pushes in flight.

It runs the one push routine (:mod:`~weight_bridge.vllm.clients.bridge_client`) on the engine's
event loop. From that loop, await :meth:`AsyncLLMClient.push_async`; from another thread (a
trainer's), call :meth:`AsyncLLMClient.push`, which needs the ``loop``. Generation from another
thread (:meth:`~AsyncLLMClient.submit`, :meth:`~AsyncLLMClient.generate`) runs on the same loop, so
pushes land while it runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
from collections.abc import Coroutine, Sequence
from typing import Any

from ..internals import core_client_of
from ..outcome import PushOutcome
from ..report import PushReport
from ..server.typed_errors import update_outcome_async
from .bridge_client import BridgeClient, InflightMode

__all__ = ["AsyncLLMClient", "token_versions"]


def token_versions(completion: Any) -> list[str]:
    """The weight version that sampled each output token of a finished ``CompletionOutput``
    (from its ``weight_versions`` spans)."""
    versions: list[str] = []
    for span in completion.weight_versions or ():
        versions += [span.version] * (span.end - span.start)
    return versions


class AsyncLLMClient(BridgeClient):
    """Pushes into, and generates with, an ``AsyncLLM`` started with the backend, in flight if
    asked.

    ``loop``: the event loop the engine runs on, for calls from another thread. ``inflight``:
    the default mode (None: push without pausing generation; the update then lands between two
    steps, with ``"keep"``'s semantics for requests running at that moment). The ``AsyncLLM``
    is the caller's: :meth:`close` leaves it running.
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
        self._ids = itertools.count()

    def _on_loop(self, coroutine: Any) -> concurrent.futures.Future:
        if self.loop is None:
            coroutine.close()
            raise RuntimeError(f"{type(self).__name__} called from another thread needs loop=")
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine: Any) -> Any:
        """Run ``coroutine`` (say, a call of the ``AsyncLLM``'s own) on the engine's loop, from
        another thread; its result."""
        return self._on_loop(coroutine).result()

    def _blocking(self, push: Coroutine[Any, Any, PushReport]) -> PushReport:
        """On the engine's loop, from another thread."""
        return self._on_loop(push).result()

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

    async def _outcome(self) -> PushOutcome | None:
        return await update_outcome_async(core_client_of(self.engine))

    async def _version(self) -> str:
        return str(await self.engine.get_weight_version())

    # -- generation --------------------------------------------------------------------------

    async def _generate_one(self, prompt: Any, sampling_params: Any) -> Any:
        last = None
        request_id = f"weight-bridge-{next(self._ids)}"
        async for output in self.engine.generate(prompt, sampling_params, request_id=request_id):
            last = output
        return last

    async def _generate(self, prompts: Sequence[Any], sampling_params: Any) -> list[Any]:
        return list(
            await asyncio.gather(*(self._generate_one(p, sampling_params) for p in prompts))
        )

    def submit(
        self, prompts: Sequence[Any], sampling_params: Any
    ) -> concurrent.futures.Future[list[Any]]:
        """Start generating ``prompts`` in the background; the future's result is their final
        ``RequestOutput``\\s, in order, each with all its ``n`` completions. Pushes meanwhile
        land in flight."""
        from vllm.sampling_params import RequestOutputKind

        final = sampling_params.clone()
        final.output_kind = RequestOutputKind.FINAL_ONLY  # one output, every completion in it
        return self._on_loop(self._generate(list(prompts), final))

    def generate(self, prompts: Sequence[Any], sampling_params: Any = None, **_: Any) -> list[Any]:
        """:meth:`submit` and wait (what the callback's canary and a synchronous caller use)."""
        return self.submit(prompts, sampling_params).result()
