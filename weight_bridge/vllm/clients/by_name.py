"""Engines by name, and a client for an engine the caller started: what a configuration (the
callback's ``engine_mode``, a YAML recipe) picks from.

Every engine the library starts is the one client (:mod:`~weight_bridge.vllm.clients.bridge_client`)
plus the engine it owns:

* ``colocated``: :class:`~weight_bridge.vllm.clients.colocated.ColocatedEngine`, a ``vllm.LLM`` in
  this process (generation and pushes take turns);
* ``async``: :class:`~weight_bridge.vllm.clients.async_colocated.AsyncColocatedEngine`, an
  ``AsyncLLM`` in this process on its own event loop (rollouts generated while the trainer trains,
  pushes landing in flight);
* ``serve``: :class:`~weight_bridge.vllm.clients.served.ServedEngine`, a ``vllm serve`` process
  started for the job, pushed over HTTP, in flight as well;
* ``ranks``: :class:`~weight_bridge.vllm.clients.ranks.RanksEngine`, a ``vllm.LLM`` inside every
  trainer rank, tensor-parallel over the trainer's world, pushed from its live tensors.

vLLM is imported only when an engine is started or recognized.
"""

from __future__ import annotations

import os
from typing import Any

from ..options import OptionError
from .bridge_client import EngineClient, check_inflight

ENGINE_MODES = ("colocated", "async", "serve", "ranks")


def start_engine(
    model: str | os.PathLike,
    mode: str = "colocated",
    inflight: str | None = "recompute",
    **kwargs: Any,
) -> EngineClient:
    """The engine of ``mode`` on ``model``; ``kwargs`` as the engine takes them (the bridge's
    options, ``kv_cache_gb``, ``plugins``, vLLM's engine arguments; ``api_key`` for
    ``serve``; ``cpu_threads_bind`` for ``ranks``). ``inflight``: the pushes' default in-flight
    mode (``async`` and ``serve``), checked before any engine starts (as every option the
    engine checks itself before it starts: the bridge's, ``kv_cache_gb``)."""
    if mode not in ENGINE_MODES:
        raise OptionError(f"engine_mode must be one of {ENGINE_MODES}, not {mode!r}")
    check_inflight(inflight if mode in ("async", "serve") else None)  # before any engine starts
    if mode == "colocated":
        from .colocated import ColocatedEngine

        return ColocatedEngine(model, **kwargs)
    if mode == "ranks":
        from .ranks import RanksEngine

        return RanksEngine(model, **kwargs)
    if mode == "async":
        from .async_colocated import AsyncColocatedEngine

        return AsyncColocatedEngine(model, inflight=inflight, **kwargs)  # type: ignore[arg-type]
    from .served import ServedEngine

    return ServedEngine(model, inflight=inflight, **kwargs)  # type: ignore[arg-type]


def connect(
    url: str, inflight: str | None = "recompute", api_key: str | None = None
) -> EngineClient:
    """A client of a ``vllm serve`` process already running with the bridge's backend."""
    from .http import HTTPClient

    return HTTPClient(url, api_key=api_key, inflight=inflight)  # type: ignore[arg-type]


def client_for(engine: Any) -> EngineClient:
    """``engine`` as something to push into: a client (anything with ``push``) as it is; a
    ``vllm.LLM`` started with the backend as its :class:`~weight_bridge.vllm.clients.llm.LLMClient`.
    An ``AsyncLLM`` needs the loop it runs on, so it must come as an
    :class:`~weight_bridge.vllm.clients.async_llm.AsyncLLMClient`."""
    if hasattr(engine, "push"):
        return engine
    from vllm import LLM
    from vllm.v1.engine.async_llm import AsyncLLM

    if isinstance(engine, LLM):
        from .llm import LLMClient

        return LLMClient(engine)
    if isinstance(engine, AsyncLLM):
        raise TypeError(
            "pass an AsyncLLM as weight_bridge.AsyncLLMClient(engine, loop=...) (the loop it "
            "runs on): the callback pushes from the trainer's thread"
        )
    raise TypeError(f"cannot push into a {type(engine).__name__}: it has no push method")
