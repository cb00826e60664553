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

from ..core.adapters import chosen_adapter
from ..generation import Generation, engine_prompt
from ..internals.engine_client import call_core_utility_async
from ..internals.lora import lora_request
from ..internals.objects import config_of, core_client_of
from ..internals.pause import pause_queueing
from ..report import PushReport
from ..server.typed_errors import update_report_async
from .bridge_client import BridgeClient, InflightMode
from .llm import _ADAPTERS, sampling_params


class AsyncLLMClient(BridgeClient):
    """Pushes into, and generates with, an ``AsyncLLM`` started with the backend, in flight if
    asked.

    ``loop``: the event loop the engine runs on, for calls from another thread; ``inflight``:
    as :class:`~.bridge_client.BridgeClient`'s. The ``AsyncLLM`` is the caller's: :meth:`close`
    leaves it running.
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
        """``drain`` (``mode="wait"``) pauses the scheduler itself: vLLM 0.33+'s
        ``pause_generation(mode="wait")`` rejects the requests that arrive meanwhile, which
        ``drain`` promises to queue (:func:`~weight_bridge.vllm.internals.pause.pause_queueing`)."""
        if mode == "wait":
            await pause_queueing(self.engine, mode, clear_cache)
            return
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

    async def _report(self) -> PushReport | None:
        return await update_report_async(core_client_of(self.engine))

    # -- generation --------------------------------------------------------------------------

    @property
    def takes_adapters(self) -> bool:  # type: ignore[override]
        """Whether the engine was started with LoRA slots (``enable_lora=True``)."""
        return config_of(self.engine).lora_config is not None

    async def _generate_one(self, prompt: Any, sampling_params: Any, adapter: Any) -> Any:
        last = None
        request_id = f"weight-bridge-{next(self._ids)}"
        async for output in self.engine.generate(
            prompt, sampling_params, request_id=request_id, lora_request=adapter
        ):
            last = output
        return last

    async def _generate(
        self, prompts: Sequence[Any], sampling_params: Any, version: Any
    ) -> list[Generation]:
        table = {}
        if self.takes_adapters:
            table = await call_core_utility_async(core_client_of(self.engine), _ADAPTERS)
        adapter = lora_request(chosen_adapter(table, version))
        outputs = await asyncio.gather(
            *(self._generate_one(p, sampling_params, adapter) for p in prompts)
        )
        top = sampling_params.logprobs
        return [Generation.from_request_output(o, top, self.version) for o in outputs]

    def submit(
        self, prompts: Sequence[Any], sampling: Any = None, version: Any = None
    ) -> concurrent.futures.Future[list[Generation]]:
        """:meth:`BridgeClient.submit <.bridge_client.BridgeClient.submit>` on the engine's
        loop; pushes meanwhile land in flight."""
        from vllm.sampling_params import RequestOutputKind

        final = sampling_params(sampling).clone()
        final.output_kind = RequestOutputKind.FINAL_ONLY  # one output, every completion in it
        prompts = [engine_prompt(p) for p in prompts]
        return self._on_loop(self._generate(prompts, final, version))
