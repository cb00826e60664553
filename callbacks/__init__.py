"""Lightning callbacks: :class:`VLLMWeightSync` keeps a colocated vLLM engine on the policy.

Its option groups: :class:`EngineSpec` (which engine: one to start, or a server's URL),
:class:`Schedule` (when), :class:`CheckpointFiles` (where), :class:`CheckpointNames` (under which
names and dtype), :class:`CanaryCheck` (an end-to-end check of each push). What it needs of an
engine it is given is :class:`weight_bridge.EngineClient`.
"""

from weight_bridge.sync import CheckpointFiles
from weight_bridge.sync.canary import CanaryCheck
from weight_bridge.sync.names import CheckpointNames

from .engine import EngineSpec
from .schedule import Schedule
from .weight_sync import VLLMWeightSync

__all__ = [
    "CanaryCheck",
    "CheckpointFiles",
    "CheckpointNames",
    "EngineSpec",
    "Schedule",
    "VLLMWeightSync",
]
