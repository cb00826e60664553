"""``AsyncColocatedEngine``: an ``AsyncLLM`` in this job that keeps generating while it is pushed.

A synchronous ``ColocatedEngine`` serializes generation and pushes: the trainer waits for every
rollout, the engine for every push. This engine runs vLLM's ``AsyncLLM`` on an event loop of its
own (a background thread), so rollouts are generated while the trainer trains (:meth:`submit`
returns a future), and a push lands *in flight*: inside ``pause_generation`` ...
``resume_generation``, with the requests running at that moment recomputed with the new
weights (``inflight="recompute"``, the default), kept on their old KV (``"keep"``) or finished
first (``"drain"``); see :mod:`.clients`. Every finished output carries vLLM's
``weight_versions`` spans (:func:`token_versions` gives each token's version).

Started like ``ColocatedEngine``: the ``weight_bridge`` backend with its options, colocated
memory defaults, a checkpoint root, and engine processes that end with this one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import itertools
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from .clients import AsyncLLMClient, InflightMode
from .launch import bridged_engine_args, engine_environment, pop_engine_options
from .results import PushReport

__all__ = ["AsyncColocatedEngine", "token_versions"]


def token_versions(completion: Any) -> list[str]:
    """The weight version that sampled each output token of a finished ``CompletionOutput``
    (from its ``weight_versions`` spans)."""
    versions: list[str] = []
    for span in completion.weight_versions or ():
        versions += [span.version] * (span.end - span.start)
    return versions


class AsyncColocatedEngine:
    """An ``AsyncLLM`` with the ``weight_bridge`` backend, on its own event loop.

    ``inflight``: how a push treats requests in flight (``recompute``, ``keep``, ``drain``, or
    None: no pause). ``cpu_threads_bind`` (CPU backend): the cores the engine's worker computes
    on (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``"1"``). Generation and training overlap
    only if they do not fight over the same cores: on a small machine give the engine its own
    and the trainer the rest (``torch.set_num_threads``); measured on 2 cores, overlapping
    without that is twice as slow as taking turns (:mod:`benchmarks.inflight`).
    ``plugins``, ``kv_cache_gb`` and the bridge's options (``checkpoint_root``,
    ``reload_mode``, ``cpu_linear``, ``readback``, ``check_finite``, ``verify_hash``,
    ``rollback``): as for :class:`~weight_bridge.vllm.ColocatedEngine`. Every other keyword
    goes to vLLM's ``AsyncEngineArgs``.
    """

    def __init__(
        self,
        model: str | os.PathLike,
        inflight: InflightMode | None = "recompute",
        plugins: Sequence[str] = (),
        kv_cache_gb: float | None = None,
        cpu_threads_bind: str | None = None,
        **engine_kwargs: Any,
    ):
        self.model = str(model)
        self.options = pop_engine_options(engine_kwargs)
        kwargs = bridged_engine_args(self.model, self.options, engine_kwargs, kv_cache_gb)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="weight-bridge-async-engine", daemon=True
        )
        self._thread.start()
        self._ids = itertools.count()
        started = time.perf_counter()
        bind = {"VLLM_CPU_OMP_THREADS_BIND": cpu_threads_bind} if cpu_threads_bind else None
        with engine_environment(plugins, bind):
            self.engine = self._run(self._start(kwargs))
        self.startup_s = time.perf_counter() - started
        self.client = AsyncLLMClient(self.engine, self.loop, inflight)

    async def _start(self, kwargs: dict[str, Any]) -> Any:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(AsyncEngineArgs(model=self.model, **kwargs))

    def _run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

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
        return asyncio.run_coroutine_threadsafe(self._generate(list(prompts), final), self.loop)

    def generate(self, prompts: Sequence[Any], sampling_params: Any = None, **_: Any) -> list[Any]:
        """:meth:`submit` and wait (what the callback's canary and a synchronous caller use)."""
        return self.submit(prompts, sampling_params).result()

    # -- weights -----------------------------------------------------------------------------

    def push(
        self,
        checkpoint: str | os.PathLike,
        version: Any = None,
        verify_hash: bool | None = None,
        inflight: Any = "default",
    ) -> PushReport:
        """Push ``checkpoint`` in flight (``inflight``: this push's mode, default the engine's);
        blocks until generation resumed. Errors as :meth:`ColocatedEngine.push`'s."""
        return self.client.push(checkpoint, version, verify_hash, inflight)

    @property
    def version(self) -> Any:
        return self.client.version

    @property
    def served_checkpoints(self) -> list[str]:
        return self.client.served_checkpoints

    # -- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Shut the engine down (on its loop), drop it, and stop the loop."""
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            self.client.engine = None

            async def shutdown() -> None:
                engine.shutdown()

            self._run(shutdown())
            del engine
            gc.collect()  # while vLLM's modules are alive: its __del__ shuts down again
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(30)

    def __enter__(self) -> AsyncColocatedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
