"""The engine a callback pushes into, described by one option.

A callback is given an engine the user built (any client of the bridge, or a ``vllm.LLM``
started with its backend), or an :class:`EngineSpec`: a model directory to start an engine on
(in the callback's ``setup``, reading checkpoints only from the sync's directory, closed at
``teardown``), or the URL of a ``vllm serve`` process already running the bridge's backend.
One option instead of loose arguments, so a LightningCLI YAML says it in one mapping::

    engine:
      model: /models/policy
      mode: serve
      args: {kv_cache_gb: 1, inflight: drain}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weight_bridge.vllm import ENGINE_MODES, EngineClient, client_for, connect, start_engine

__all__ = ["EngineSpec"]


@dataclass(frozen=True)
class EngineSpec:
    """Which engine to push into: start one on ``model`` (``mode``: ``"colocated"``, a
    ``vllm.LLM`` in this process; ``"async"``, an ``AsyncLLM`` on its own loop; ``"serve"``, a
    ``vllm serve`` process; ``"ranks"``, a ``vllm.LLM`` inside every trainer rank,
    tensor-parallel over them and pushed from the live tensors, no file) or connect to ``url``;
    ``args``: what that engine or client takes (the bridge's options such as ``readback``,
    ``kv_cache_gb``, vLLM's engine arguments; ``inflight``, what a push does to requests in
    flight, where there can be any: ``async``, ``serve`` and ``url``; ``api_key`` for ``serve``
    and ``url``; ``cpu_threads_bind`` for ``ranks``)."""

    model: str | None = None
    url: str | None = None
    mode: str = "colocated"
    args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.model is None) == (self.url is None):
            raise ValueError("an EngineSpec needs a model to start an engine on, or a url")
        if self.mode not in ENGINE_MODES:
            raise ValueError(f"engine mode must be one of {ENGINE_MODES}, not {self.mode!r}")
        if self.url is not None and self.mode != "colocated":
            raise ValueError(f"an engine at a url is already running: no mode ({self.mode!r})")
        if (
            self.model is not None
            and self.mode in ("colocated", "ranks")
            and "inflight" in self.args
        ):
            raise ValueError(
                f"a {self.mode} engine generates and is pushed on the same thread, so no request "
                "is in flight during a push: inflight applies to mode 'async' or 'serve'"
            )

    @property
    def in_ranks(self) -> bool:
        """Whether the engine runs inside the trainer's ranks (pushed from live tensors)."""
        return self.model is not None and self.mode == "ranks"

    @property
    def starts(self) -> bool:
        """Whether the callback starts (and closes) the engine."""
        return self.model is not None

    def connect(self) -> EngineClient:
        """A client of the running server at ``url``."""
        assert self.url is not None
        return connect(self.url, **self.args)

    def start(self, checkpoint_root: Path, devices_per_node: int = 1) -> EngineClient:
        """The engine on ``model``, reading checkpoints from ``checkpoint_root`` only; in the
        trainer's ranks tensor-parallel over a node's ``devices_per_node`` ranks (the trainer's
        own count: ``LOCAL_WORLD_SIZE`` may be stale, vLLM's CPU platform rewrites it in any
        process that started an engine) unless ``args`` says otherwise."""
        assert self.model is not None
        args = {"checkpoint_root": str(checkpoint_root), **self.args}
        if self.in_ranks:
            args.setdefault("tensor_parallel_size", devices_per_node)
        return start_engine(self.model, self.mode, **args)


def engine_of(engine: EngineSpec | dict[str, Any] | Any) -> tuple[EngineSpec | None, Any]:
    """A callback's ``engine``: its spec (a mapping from YAML becomes one) and the client
    ready now (None until an engine to start is started)."""
    if engine is None:
        return None, None
    if isinstance(engine, dict):
        engine = EngineSpec(**engine)
    if isinstance(engine, EngineSpec):
        return engine, None if engine.starts else engine.connect()
    return None, client_for(engine)
