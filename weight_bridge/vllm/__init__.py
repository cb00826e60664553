"""vLLM integration: a general plugin, a worker extension and ``ColocatedEngine``.

Limitations:
1. Only vLLM's default safetensors loader is bridged (the checkpoint is captured as it loads).
2. Derived state is refreshed for the CPU backend's packed linears and its unquantized MoE
   experts prepack; other derived state or transformed weights are re-processed by vLLM's
   layerwise path (``auto``, for modules whose own processing made the change) or refused.
3. Kernel objects created by processing on modules that hold no weight (e.g. a MoE kernel
   built from the configuration) are taken as not holding weight values; a kernel that copied
   weights into one would be missed by the proof (the callback's canary would catch it).
4. Each worker reads the checkpoint from a path it can open: colocated means same filesystem.
"""

from .engine import (
    ColocatedEngine,
    EngineCoreDeadError,
    EngineUndefinedError,
    PushReport,
    token_prompts,
)

__all__ = [
    "ColocatedEngine",
    "EngineCoreDeadError",
    "EngineUndefinedError",
    "PushReport",
    "token_prompts",
]
