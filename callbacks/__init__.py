"""Lightning callbacks: :class:`VLLMWeightSync` keeps a colocated vLLM engine on the policy."""

from .weight_sync import VLLMWeightSync

__all__ = ["VLLMWeightSync"]
