"""How the bridge's own engines (:class:`~weight_bridge.ColocatedEngine`,
:class:`~weight_bridge.vllm.clients.async_colocated.AsyncColocatedEngine`) start vLLM: the engine
arguments (the backend, its options, colocated memory defaults), the environment their engine
processes inherit."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

from ..internals.versions import check_vllm_version
from ..lifeline import FRONTEND_ENV
from ..options import BACKEND, BridgeOptions
from ..plugin import PLUGINS_ENV, run_engine_plugins


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


def bridged_engine_args(
    model: str, options: BridgeOptions, engine_kwargs: dict[str, Any], kv_cache_gb: float | None
) -> dict[str, Any]:
    """``engine_kwargs`` (for ``vllm.LLM`` or ``AsyncEngineArgs``) with the bridge wired in: the
    ``weight_bridge`` backend, ``options`` in ``additional_config`` (merged with the caller's),
    and colocated memory defaults (:mod:`~weight_bridge.vllm.clients.memory`). A
    ``worker_extension_cls`` of the caller's goes to vLLM as it is: the bridge reaches its workers
    through its backend (:func:`~weight_bridge.vllm.worker.backend.call_backend`), not through an
    extension."""
    from .memory import colocated_llm_kwargs

    check_vllm_version()  # refused here, before an engine starts, on an untested vLLM
    kwargs = dict(engine_kwargs)
    extra = dict(kwargs.pop("additional_config", None) or {})
    extra.update(options.as_config())
    kwargs["additional_config"] = extra
    kwargs["weight_transfer_config"] = {"backend": BACKEND}
    return colocated_llm_kwargs(model, kwargs, kv_cache_gb)
