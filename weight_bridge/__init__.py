"""weight-bridge: keep a colocated vLLM engine on the freshest policy by direct in-place reload.

The core (layout records, direct reload, safetensors checkpoints) is plain PyTorch; the vLLM
integration lives in :mod:`weight_bridge.vllm` and the Lightning callback in ``callbacks``,
both imported only when used.
"""

from .checkpoint import CheckpointError, CheckpointReader, CheckpointWriteError, save_checkpoint
from .direct import (
    DirectReloadError,
    OpenReload,
    Proof,
    Refresher,
    ReloadPlan,
    ReloadReport,
    Reprocessor,
    direct_reload,
    direct_reload_session,
    plan_direct_reload,
    prove_checkpoint_layout,
    record_checkpoint_layout,
)
from .layout import CheckpointLayout

__all__ = [
    # checkpoints
    "save_checkpoint",
    "CheckpointReader",
    "CheckpointError",
    "CheckpointWriteError",
    # direct reload: what a user calls, and what it returns
    "record_checkpoint_layout",
    "prove_checkpoint_layout",
    "direct_reload",
    "direct_reload_session",
    "plan_direct_reload",
    "DirectReloadError",
    "CheckpointLayout",
    "OpenReload",
    "Proof",
    "ReloadPlan",
    "ReloadReport",
    # extension points
    "Refresher",
    "Reprocessor",
]
