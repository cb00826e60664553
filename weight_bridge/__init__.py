"""weight-bridge: keep a colocated vLLM engine on the freshest policy by direct in-place reload.

The core (layout records, direct reload, safetensors checkpoints) is plain PyTorch; the vLLM
integration lives in :mod:`weight_bridge.vllm` and is imported lazily.
"""

from .checkpoint import CheckpointError, CheckpointReader, CheckpointWriteError, save_checkpoint
from .direct import (
    DirectReloadError,
    Refresher,
    ReloadReport,
    begin_direct_reload,
    direct_reload,
    direct_reload_session,
    finish_direct_reload,
    plan_direct_reload,
    prove_checkpoint_layout,
    resolve_target,
)
from .layout import CheckpointLayout, TensorLayout, record_checkpoint_layout

__all__ = [
    "CheckpointError",
    "CheckpointLayout",
    "CheckpointReader",
    "CheckpointWriteError",
    "DirectReloadError",
    "Refresher",
    "ReloadReport",
    "TensorLayout",
    "begin_direct_reload",
    "direct_reload",
    "direct_reload_session",
    "finish_direct_reload",
    "plan_direct_reload",
    "prove_checkpoint_layout",
    "record_checkpoint_layout",
    "resolve_target",
    "save_checkpoint",
]
