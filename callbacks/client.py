"""The seam between the callback and an engine: what the callback needs of one, and how it
builds one from a model directory.

The callback talks to any object with :class:`EngineClient`'s methods: ``push`` (a checkpoint
path, a version, whether to verify its hash) and ``served_checkpoints`` (the files the served
version is made of, which are never deleted), plus ``version`` for its messages and ``generate``
for the canary. :class:`~weight_bridge.vllm.ColocatedEngine` is one; clients of a ``vllm.LLM``,
an ``AsyncLLM`` or a server URL can stand in its place. vLLM is imported only when an engine is
built, so a trainer-only install imports the callback.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = ["EngineClient", "build_engine"]


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

    def generate(self, prompts: Any, sampling_params: Any = None, **kwargs: Any) -> list[Any]: ...

    def close(self) -> None: ...


def build_engine(model_path: str, checkpoint_root: Path, engine_kwargs: dict) -> EngineClient:
    """A colocated engine on ``model_path`` that may read checkpoints from ``checkpoint_root``
    only (the sync's directory; a ``checkpoint_root`` in ``engine_kwargs`` wins)."""
    from weight_bridge.vllm.engine import ColocatedEngine

    kwargs = {"checkpoint_root": str(checkpoint_root), **engine_kwargs}
    return ColocatedEngine(model_path, **kwargs)
