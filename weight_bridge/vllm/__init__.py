"""vLLM integration: the ``weight_bridge`` weight-transfer backend, its plugin, and clients.

An engine started with ``weight_transfer_config={"backend": "weight_bridge"}`` (``LLM``,
``AsyncLLM`` or ``vllm serve``) takes updates through vLLM's own RL API, each a proven,
transactional direct reload (:mod:`.backend`). :class:`ColocatedEngine` is a convenience over
the same path for a ``vllm.LLM`` in the trainer's process.

Limitations:
1. Only vLLM's default safetensors loader is bridged (the checkpoint is captured as it loads).
2. Derived state is refreshed for the CPU backend's packed linears and its unquantized MoE
   experts prepack; other derived state or transformed weights are re-processed by vLLM's
   layerwise path (``auto``, for modules whose own processing made the change) or refused.
3. Kernel objects created by processing on modules that hold no weight (e.g. a MoE kernel
   built from the configuration) are taken as not holding weight values; a kernel that copied
   weights into one would be missed by the proof (the callback's canary would catch it).
4. Each worker reads the checkpoint from a path it can open, under the engine's checkpoint
   root: colocated means same filesystem.
5. With vLLM's asynchronous scheduling (a batch queue; off on the CPU backend, on by default on
   GPUs) a step already queued when an update commits would have its output stamped with the
   new version; the bridge stamps at commit assuming steps run one at a time (not run here).
6. An engine left undefined (a rollback that failed too) stops scheduling; a plain ``vllm.LLM``
   caller's ``generate`` then waits until a complete update succeeds (``ColocatedEngine``
   refuses instead).
"""

from .engine import (
    ColocatedEngine,
    EngineCoreDeadError,
    EngineUndefinedError,
    PushReport,
    token_prompts,
)
from .options import BACKEND, BridgeOptions
from .results import UpdateInProgressError

__all__ = [
    "BACKEND",
    "BridgeOptions",
    "ColocatedEngine",
    "EngineCoreDeadError",
    "EngineUndefinedError",
    "PushReport",
    "UpdateInProgressError",
    "token_prompts",
]
