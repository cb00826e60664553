"""weight-bridge: keep a colocated vLLM engine on the freshest policy by direct in-place reload.

What a user imports is here (the Lightning callback is ``callbacks.VLLMWeightSync``):

* **engines and clients** (:mod:`weight_bridge.vllm`): :class:`ColocatedEngine`,
  :class:`AsyncColocatedEngine`, :class:`ServedEngine` (an engine the library starts: the one
  client plus the engine it owns), :class:`LLMClient`, :class:`AsyncLLMClient`,
  :class:`HTTPClient` (for an engine you started), :func:`start_engine`, :func:`connect`,
  their options (:class:`BridgeOptions`), report (:class:`PushReport`) and what ``generate``
  returns, the same from every client (:class:`Generation`, :class:`Completion`,
  :class:`VersionSpan`);
* **checkpoints** (:mod:`weight_bridge.checkpoint`): :func:`save_checkpoint`,
  :class:`CheckpointReader`;
* **errors**: every error a push or a save raises, each derived from
  :class:`WeightBridgeError` (the base of every exception the project raises).

The direct-reload core (layout records, proofs, plans, sessions; plain PyTorch, no vLLM) is
:mod:`weight_bridge.direct`. Names from :mod:`weight_bridge.vllm` are imported on first use,
so ``import weight_bridge`` (and the callback) works in a trainer without vLLM.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .checkpoint import CheckpointError, CheckpointReader, CheckpointWriteError, save_checkpoint
from .direct import DirectReloadError
from .errors import WeightBridgeError

if TYPE_CHECKING:  # typed for mypy and IDEs; at run time imported from .vllm on first use
    from .vllm.clients.async_colocated import AsyncColocatedEngine
    from .vllm.clients.async_llm import AsyncLLMClient
    from .vllm.clients.bridge_client import EngineClient
    from .vllm.clients.by_name import connect, start_engine
    from .vllm.clients.colocated import ColocatedEngine
    from .vllm.clients.http import HTTPClient, RemoteUpdateError
    from .vllm.clients.llm import LLMClient, token_prompts
    from .vllm.clients.ranks import RanksEngine
    from .vllm.clients.served import ServedEngine, VLLMServer
    from .vllm.errors import EngineUndefinedError, UpdateInProgressError
    from .vllm.generation import Completion, Generation, VersionSpan
    from .vllm.internals.engine_client import EngineCoreDeadError
    from .vllm.options import BridgeOptions
    from .vllm.report import PushReport

__all__ = [
    # engines and clients
    "ColocatedEngine",
    "AsyncColocatedEngine",
    "ServedEngine",
    "RanksEngine",
    "VLLMServer",
    "LLMClient",
    "AsyncLLMClient",
    "HTTPClient",
    "EngineClient",
    "start_engine",
    "connect",
    "BridgeOptions",
    "PushReport",
    "token_prompts",
    # what generate returns
    "Generation",
    "Completion",
    "VersionSpan",
    # checkpoints
    "save_checkpoint",
    "CheckpointReader",
    # errors: every one derives from WeightBridgeError
    "WeightBridgeError",
    "CheckpointError",
    "CheckpointWriteError",
    "DirectReloadError",
    "EngineCoreDeadError",
    "EngineUndefinedError",
    "RemoteUpdateError",
    "UpdateInProgressError",
]

# each name's module under .vllm, imported on first use (``import weight_bridge`` needs no vLLM)
_FROM_VLLM = {
    "AsyncColocatedEngine": "clients.async_colocated",
    "AsyncLLMClient": "clients.async_llm",
    "EngineClient": "clients.bridge_client",
    "connect": "clients.by_name",
    "start_engine": "clients.by_name",
    "ColocatedEngine": "clients.colocated",
    "HTTPClient": "clients.http",
    "RemoteUpdateError": "clients.http",
    "LLMClient": "clients.llm",
    "token_prompts": "clients.llm",
    "RanksEngine": "clients.ranks",
    "ServedEngine": "clients.served",
    "VLLMServer": "clients.served",
    "EngineUndefinedError": "errors",
    "UpdateInProgressError": "errors",
    "Completion": "generation",
    "Generation": "generation",
    "VersionSpan": "generation",
    "EngineCoreDeadError": "internals.engine_client",
    "BridgeOptions": "options",
    "PushReport": "report",
}


def __getattr__(name: str) -> Any:
    module = _FROM_VLLM.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".vllm.{module}", __name__), name)
