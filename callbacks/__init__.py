"""Lightning callbacks: :class:`VLLMWeightSync` keeps a colocated vLLM engine on the policy.

Its option groups: :class:`Schedule` (when), :class:`CheckpointFiles` (where),
:class:`CheckpointNames` (under which names and dtype), :class:`CanaryCheck` (an end-to-end check
of each push). :class:`EngineClient` is what it needs of an engine.
"""

from .canary import CanaryCheck
from .client import EngineClient
from .names import CheckpointNames
from .retention import CheckpointFiles
from .schedule import Schedule
from .weight_sync import VLLMWeightSync

__all__ = [
    "CanaryCheck",
    "CheckpointFiles",
    "CheckpointNames",
    "EngineClient",
    "Schedule",
    "VLLMWeightSync",
]
