"""``AsyncColocatedEngine``: an ``AsyncLLM`` in this job that keeps generating while it is pushed.

A synchronous ``ColocatedEngine`` serializes generation and pushes: the trainer waits for every
rollout, the engine for every push. This engine runs vLLM's ``AsyncLLM`` on an event loop of its
own (a background thread), so rollouts are generated while the trainer trains
(:meth:`AsyncColocatedEngine.submit` returns a future), and a push lands *in flight*
(``inflight``, default ``"recompute"``: see :mod:`~weight_bridge.vllm.clients.bridge_client`).
Every finished output carries vLLM's ``weight_versions`` spans
(:attr:`~weight_bridge.vllm.generation.Completion.versions`).

It is the one client of an ``AsyncLLM``
(:class:`~weight_bridge.vllm.clients.async_llm.AsyncLLMClient`) plus the engine it owns, started
like ``ColocatedEngine``: the ``weight_bridge`` backend with its options, colocated memory defaults,
a checkpoint root, and engine processes that end with this one.
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from ..options import BridgeOptions
from .async_llm import AsyncLLMClient
from .bridge_client import InflightMode
from .launch import bridged_engine_args, engine_environment


class AsyncColocatedEngine(AsyncLLMClient):
    """An ``AsyncLLM`` with the ``weight_bridge`` backend, on its own event loop, and its client.

    ``inflight``: how a push treats requests in flight (``recompute``, ``keep``, ``drain``, or
    None: no pause). ``cpu_threads_bind`` (CPU backend): the cores the engine's worker computes
    on (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``"1"``). Generation and training overlap
    only if they do not fight over the same cores: on a small machine give the engine its own
    and the trainer the rest (``torch.set_num_threads``); measured on 2 cores, overlapping
    without that is twice as slow as taking turns (:mod:`benchmarks.inflight`).
    ``plugins``, ``kv_cache_gb`` and the bridge's options (any field of
    :class:`~weight_bridge.vllm.options.BridgeOptions`): as for
    :class:`~weight_bridge.ColocatedEngine`. Every other keyword goes to vLLM's
    ``AsyncEngineArgs``.
    """

    def __init__(
        self,
        model: str | os.PathLike,
        inflight: InflightMode | None = "recompute",
        plugins: Sequence[str] = (),
        kv_cache_gb: float | None = None,
        cpu_threads_bind: str | int | None = None,
        **kwargs: Any,
    ):
        self.model = str(model)
        self.options, engine_kwargs = BridgeOptions.split(kwargs)
        engine_kwargs = bridged_engine_args(self.model, self.options, engine_kwargs, kv_cache_gb)
        loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=loop.run_forever, name="weight-bridge-async-engine", daemon=True
        )
        self._thread.start()
        started = time.perf_counter()
        # A YAML recipe's ``"1"`` may arrive as the int 1 through a mapping of Any.
        bind = {"VLLM_CPU_OMP_THREADS_BIND": str(cpu_threads_bind)} if cpu_threads_bind else None
        with engine_environment(plugins, bind):
            start = self._start_engine(engine_kwargs)
            engine = asyncio.run_coroutine_threadsafe(start, loop).result()
        self.startup_s = time.perf_counter() - started
        super().__init__(engine, loop, inflight)

    async def _start_engine(self, kwargs: dict[str, Any]) -> Any:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(AsyncEngineArgs(model=self.model, **kwargs))

    def close(self) -> None:
        """Shut the engine down (on its loop), drop it, and stop the loop."""
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:

            async def shutdown() -> None:
                engine.shutdown()

            self._on_loop(shutdown()).result()
            del engine
            gc.collect()  # while vLLM's modules are alive: its __del__ shuts down again
        if self.loop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(30)
