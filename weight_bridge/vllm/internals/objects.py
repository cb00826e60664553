"""Reads and writes of vLLM objects' own attributes that are not part of vLLM's public API:
which engine-core client an ``LLM`` or ``AsyncLLM`` talks through, an engine's configuration,
the bridge's state kept on an engine core, a message queue's busy-loop window, the model names
an API server serves.

Every other module takes these from here, so an upgrade checks them in one place (the checklist
in :mod:`weight_bridge.vllm.internals`, items 14, 17 and 18).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")
_STATE = "_weight_bridge"


def core_client_of(engine: Any) -> Any:
    """The engine-core client of a ``vllm.LLM`` (``llm_engine.engine_core``) or an ``AsyncLLM``
    (``engine_core``)."""
    llm_engine = getattr(engine, "llm_engine", None)
    return (llm_engine if llm_engine is not None else engine).engine_core


def config_of(engine: Any) -> Any:
    """The ``VllmConfig`` of an ``LLM`` (its ``llm_engine``'s), an ``AsyncLLM``, an engine core
    or a worker."""
    config = getattr(engine, "vllm_config", None)
    if config is None and getattr(engine, "llm_engine", None) is not None:
        config = engine.llm_engine.vllm_config
    return config


def server_engine(request: Any) -> Any:
    """The ``AsyncLLM`` behind a ``vllm serve`` request."""
    return request.app.state.engine_client


def server_core_client(request: Any) -> Any:
    """The engine-core client of the ``AsyncLLM`` behind a ``vllm serve`` request."""
    return server_engine(request).engine_core


def served_models(request: Any) -> Any:
    """vLLM's ``OpenAIServingModels`` of a ``vllm serve`` app: where a request's ``model`` is
    looked up (a base name, else a key of its ``lora_requests``)."""
    return request.app.state.openai_serving_models


def served_name(models: Any) -> str:
    """The first served model name (``--served-model-name``, else ``--model``)."""
    return str(models.base_model_paths[0].name)


def named_adapters(models: Any) -> dict[str, Any]:
    """The live ``{model name: LoRARequest}`` a request's ``model`` is looked up in first."""
    return models.lora_requests


def add_base_name(models: Any, name: str) -> None:
    """Serve the base weights under one more model name (a request naming no adapter)."""
    if not models.is_base_model(name):
        from vllm.entrypoints.openai.models.protocol import BaseModelPath

        path = models.base_model_paths[0].model_path
        models.base_model_paths.append(BaseModelPath(name=name, model_path=path))


async def model_list(models: Any) -> dict[str, Any]:
    """What vLLM's ``GET /v1/models`` answers, as JSON (``data``: a card per name, base names
    first, then each LoRA name)."""
    listed = await models.show_available_models()
    return dict(listed.model_dump())


def bridge_state_of(core: Any, new: Callable[[], _T]) -> _T:
    """The bridge's state kept on one engine core (made by ``new`` on first use): the engine
    core object is vLLM's, so the bridge keeps its per-core state in the instance dict."""
    state = core.__dict__.get(_STATE)
    if state is None:
        state = core.__dict__[_STATE] = new()
    return state


def spin_window(condition: Any) -> float:
    """How long a message-queue reader (``SpinCondition``) spins before it sleeps, in s."""
    return float(condition.busy_loop_s)


def set_spin_window(condition: Any, seconds: float) -> None:
    condition.busy_loop_s = seconds
