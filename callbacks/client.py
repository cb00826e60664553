"""The seam between the callback and an engine: what the callback needs of one, and how it
builds one from a model directory.

The callback talks to any object with :class:`EngineClient`'s methods: ``push`` (a checkpoint
path, a version, whether to verify its hash) and ``served_checkpoints`` (the files the served
version is made of, which are never deleted), plus ``version`` for its messages; the canary
also needs ``generate`` (vLLM's, with prompt logprobs: the in-process engines have it, a server
client does not). :class:`~weight_bridge.vllm.ColocatedEngine` is one; clients of a ``vllm.LLM``,
an ``AsyncLLM`` or a server URL can stand in its place. vLLM is imported only when an engine is
built, so a trainer-only install imports the callback.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = ["ENGINE_MODES", "EngineClient", "as_client", "build_engine", "connect"]


@runtime_checkable
class EngineClient(Protocol):
    """What :class:`~callbacks.VLLMWeightSync` needs of an engine."""

    def push(
        self, path: str | os.PathLike, version: Any = None, verify_hash: bool = False
    ) -> Any: ...

    @property
    def served_checkpoints(self) -> list[str]: ...

    @property
    def version(self) -> Any: ...

    def close(self) -> None: ...


ENGINE_MODES = ("colocated", "async", "serve")


def build_engine(
    model_path: str,
    checkpoint_root: Path,
    engine_kwargs: dict,
    mode: str = "colocated",
    inflight: str | None = "recompute",
) -> EngineClient:
    """An engine on ``model_path`` that may read checkpoints from ``checkpoint_root`` only (the
    sync's directory; a ``checkpoint_root`` in ``engine_kwargs`` wins).

    ``mode``: ``colocated`` (a ``vllm.LLM`` in this process: generation and pushes take turns),
    ``async`` (an ``AsyncLLM`` in this process on its own event loop: rollouts generated while
    the trainer trains, pushes landing in flight as ``inflight`` says) or ``serve`` (a ``vllm
    serve`` process started for the job, pushed over HTTP, in flight as well).
    """
    if mode not in ENGINE_MODES:
        raise ValueError(f"engine_mode must be one of {ENGINE_MODES}, not {mode!r}")
    kwargs = {"checkpoint_root": str(checkpoint_root), **engine_kwargs}
    if mode == "colocated":
        from weight_bridge.vllm.engine import ColocatedEngine

        return ColocatedEngine(model_path, **kwargs)
    if mode == "async":
        from weight_bridge.vllm.async_engine import AsyncColocatedEngine

        return AsyncColocatedEngine(model_path, inflight=inflight, **kwargs)  # type: ignore[arg-type]
    from weight_bridge.vllm.options import BridgeOptions
    from weight_bridge.vllm.server import ServedEngine

    bridge = {k: kwargs.pop(k) for k in list(kwargs) if k in BridgeOptions.__dataclass_fields__}
    kv_cache_gb = kwargs.pop("kv_cache_gb", None)
    api_key = kwargs.pop("api_key", None)  # required on every route of the server
    kwargs.pop("plugins", None)
    options = BridgeOptions(**bridge)
    return ServedEngine(model_path, options, kwargs, kv_cache_gb, inflight, api_key=api_key)


def connect(
    url: str, inflight: str | None = "recompute", api_key: str | None = None
) -> EngineClient:
    """A client of a ``vllm serve`` process already running with the bridge's backend, whose
    checkpoint root holds the sync's directory."""
    from weight_bridge.vllm.clients import HTTPClient

    return HTTPClient(url, api_key=api_key, inflight=inflight)  # type: ignore[arg-type]


def as_client(engine: Any) -> EngineClient:
    """``engine`` as something the callback can push: a ``vllm.LLM`` started with the backend
    becomes an :class:`~weight_bridge.vllm.clients.LLMClient`; an ``AsyncLLM`` must come as an
    :class:`~weight_bridge.vllm.clients.AsyncLLMClient` (it needs the loop the engine runs on);
    anything with ``push`` is taken as it is."""
    if hasattr(engine, "push"):
        return engine
    kind = type(engine).__name__
    if kind == "LLM":
        from weight_bridge.vllm.clients import LLMClient

        return LLMClient(engine)
    if kind == "AsyncLLM":
        raise TypeError(
            "pass an AsyncLLM as weight_bridge.vllm.clients.AsyncLLMClient(engine, loop=...) "
            "(the loop it runs on): the callback pushes from the trainer's thread"
        )
    raise TypeError(f"cannot push into a {kind}: it has no push method")
