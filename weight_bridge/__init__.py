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
    from .vllm import (
        AsyncColocatedEngine,
        AsyncLLMClient,
        BridgeOptions,
        ColocatedEngine,
        Completion,
        EngineClient,
        EngineCoreDeadError,
        EngineUndefinedError,
        Generation,
        HTTPClient,
        LLMClient,
        PushReport,
        RanksEngine,
        RemoteUpdateError,
        ServedEngine,
        UpdateInProgressError,
        VersionSpan,
        VLLMServer,
        connect,
        start_engine,
        token_prompts,
    )

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

_FROM_VLLM = {
    name
    for name in __all__
    if name
    not in {
        "save_checkpoint",
        "CheckpointReader",
        "CheckpointError",
        "CheckpointWriteError",
        "DirectReloadError",
        "WeightBridgeError",
    }
}


def __getattr__(name: str) -> Any:
    if name in _FROM_VLLM:
        return getattr(importlib.import_module(".vllm", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
