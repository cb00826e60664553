"""vLLM integration: a general plugin, a worker extension and ``ColocatedEngine``.

Limitations:
1. Only vLLM's default safetensors loader is bridged (the checkpoint is captured as it loads).
2. Direct reload writes weights only; state derived from them by post-load processing is
   refreshed for the CPU backend's packed linears and nothing else.
3. Each worker reads the checkpoint from a path it can open: colocated means same filesystem.
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
