"""How the bridge's own engines (:class:`~weight_bridge.vllm.ColocatedEngine`,
:class:`~weight_bridge.vllm.async_engine.AsyncColocatedEngine`) start vLLM: the engine arguments
(the backend, its options, the worker extension, colocated memory defaults), the environment
their engine processes inherit."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .lifeline import FRONTEND_ENV
from .options import BACKEND, BridgeOptions
from .plugin import PLUGINS_ENV, run_engine_plugins

__all__ = [
    "ROOT_ENV",
    "WORKER_EXTENSION",
    "bridged_engine_args",
    "default_checkpoint_root",
    "engine_options",
    "pop_engine_options",
    "engine_environment",
    "worker_extension",
]

WORKER_EXTENSION = "weight_bridge.vllm.worker.WeightBridgeWorkerExtension"
ROOT_ENV = "WEIGHT_BRIDGE_CHECKPOINT_ROOT"  # the default checkpoint root of the bridge's engines


def default_checkpoint_root() -> str:
    """``$WEIGHT_BRIDGE_CHECKPOINT_ROOT``, else the current directory."""
    return os.environ.get(ROOT_ENV) or os.getcwd()


def engine_options(
    checkpoint_root: str | os.PathLike | None = None, **fields: Any
) -> BridgeOptions:
    """The options of one of the bridge's own engines: ``fields`` of
    :class:`~.options.BridgeOptions`, the checkpoint root defaulting to
    :func:`default_checkpoint_root`, resolved."""
    root = Path(checkpoint_root or default_checkpoint_root()).resolve()
    return BridgeOptions(checkpoint_root=str(root), **fields)


def pop_engine_options(kwargs: dict[str, Any]) -> BridgeOptions:
    """:func:`engine_options` from the :class:`~.options.BridgeOptions` fields found in
    ``kwargs``, removed from it (the rest are vLLM's)."""
    names = [f.name for f in dataclasses.fields(BridgeOptions)]
    return engine_options(**{k: kwargs.pop(k) for k in names if k in kwargs})


@contextlib.contextmanager
def engine_environment(
    plugins: Sequence[str], extra: dict[str, str] | None = None
) -> Iterator[None]:
    """The environment the engine processes started inside this block inherit: ``plugins``
    (run here too, and in no other engine), this process's id, which the engine core watches
    so that it does not outlive this process (:mod:`weight_bridge.vllm.lifeline`), and
    ``extra`` variables (vLLM reads its own, such as ``VLLM_CPU_OMP_THREADS_BIND``, there)."""
    values = {FRONTEND_ENV: str(os.getpid()), **(extra or {})}
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


def bridged_engine_args(
    model: str, options: BridgeOptions, engine_kwargs: dict[str, Any], kv_cache_gb: float | None
) -> dict[str, Any]:
    """``engine_kwargs`` (for ``vllm.LLM`` or ``AsyncEngineArgs``) with the bridge wired in: the
    ``weight_bridge`` backend, ``options`` in ``additional_config`` (merged with the caller's),
    the bridge's worker extension (or a subclass the caller named), and colocated memory
    defaults (:mod:`.memory`)."""
    from .memory import colocated_llm_kwargs

    kwargs = dict(engine_kwargs)
    extra = dict(kwargs.pop("additional_config", None) or {})
    extra.update(options.as_config())
    kwargs["additional_config"] = extra
    kwargs["worker_extension_cls"] = worker_extension(kwargs.get("worker_extension_cls"))
    kwargs["weight_transfer_config"] = {"backend": BACKEND}
    return colocated_llm_kwargs(model, kwargs, kv_cache_gb)
