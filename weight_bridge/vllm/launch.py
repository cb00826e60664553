"""How a :class:`~weight_bridge.vllm.ColocatedEngine` starts vLLM: the environment its engine
processes inherit and the worker extension vLLM mixes into its workers."""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator, Sequence

from .lifeline import FRONTEND_ENV
from .plugin import PLUGINS_ENV, run_engine_plugins

__all__ = ["WORKER_EXTENSION", "engine_environment", "worker_extension"]

WORKER_EXTENSION = "weight_bridge.vllm.worker.WeightBridgeWorkerExtension"


@contextlib.contextmanager
def engine_environment(plugins: Sequence[str]) -> Iterator[None]:
    """The environment the engine processes started inside this block inherit: ``plugins``
    (run here too, and in no other engine) and this process's id, which the engine core
    watches so that it does not outlive this process (:mod:`weight_bridge.vllm.lifeline`)."""
    values = {FRONTEND_ENV: str(os.getpid())}
    if plugins:
        before = os.environ.get(PLUGINS_ENV)
        values[PLUGINS_ENV] = ",".join([*filter(None, (before or "").split(",")), *plugins])
        run_engine_plugins(values[PLUGINS_ENV])
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def worker_extension(requested: str | None) -> str:
    """The bridge's worker extension, or the user's if it extends the bridge's.

    vLLM mixes exactly one extension class into its workers; one that does not subclass the
    bridge's would silently drop the bridge's methods, so it is refused with the way out.
    """
    if requested is None or requested == WORKER_EXTENSION:
        return WORKER_EXTENSION
    from .worker import WeightBridgeWorkerExtension

    module, _, name = requested.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, WeightBridgeWorkerExtension)):
        raise ValueError(
            f"worker_extension_cls={requested!r} would replace the bridge's worker methods: "
            f"make it a subclass of {WORKER_EXTENSION} (both sets of methods are then available)"
        )
    return requested
