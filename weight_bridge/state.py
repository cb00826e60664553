"""The bridge's per-model state: one object, attached to the model under one attribute.

Everything the bridge remembers about a model lives here (the layout recorded at load, the
module snapshot taken then, the proof computed after post-load processing, the refreshers of
derived state, the undefined mark and the open write session), so a reader finds it in one
place and nothing else is attached to ``nn.Module`` objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .direct.proof import ModuleSnapshot, Proof, Refresher
    from .layout import CheckpointLayout

__all__ = ["BridgeState", "bridge_state"]

STATE_ATTR = "_weight_bridge"


@dataclass
class BridgeState:
    """What the bridge knows about one model."""

    layout: CheckpointLayout | None = None
    snapshot: dict[str, ModuleSnapshot] | None = None
    proof: Proof | None = None
    refreshers: dict[str, Refresher] = field(default_factory=dict)
    reprocessable: set[str] = field(default_factory=set)
    undefined: str | None = None
    session: Any = None


def bridge_state(model: torch.nn.Module) -> BridgeState:
    """The model's bridge state, created empty on first use."""
    state = model.__dict__.get(STATE_ATTR)
    if state is None:
        state = BridgeState()
        model.__dict__[STATE_ATTR] = state
    return state
