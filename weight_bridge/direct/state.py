"""The bridge's per-model state: one object, attached to the model under one attribute.

Everything the bridge remembers about a model lives here (the layout recorded at load, the
module snapshot taken then, the proof computed after post-load processing, the refreshers of
derived state, the modules the engine can re-process, the undefined mark, whether a write is
in progress, and the last plan, kept while the model's addresses stay the same), so a reader
finds it in one place and nothing else is attached to ``nn.Module`` objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..layout import CheckpointLayout
from .extension import Refresher
from .proof import Proof
from .snapshot import ModuleSnapshot
from .write_map import WriteMap

STATE_ATTR = "_weight_bridge"


@dataclass
class BridgeState:
    """What the bridge knows about one model.

    ``undefined``: why the weights are half-written (a write failed mid-way), until a complete
    write succeeds. ``writing``: a write session is open (sessions do not nest).
    ``plan_cache``: the last plan and what it was computed for (see :mod:`.plan`).
    ``write_map``: where each checkpoint element lands, learned from the last complete direct
    write (:mod:`.write_map`; what a delta is applied with). ``fingerprints``: checkpoint name
    -> the exact fingerprint (:mod:`weight_bridge.exact`) of the full tensor served now, where
    known (a delta's base). ``writes``: how many writes of the weights have ended, by any
    writer and with any outcome (:func:`note_written`): what a copy of the weights is dated by,
    so whether it still holds what the engine holds is derived, not told
    (:class:`~.undo.HostStore`).
    """

    layout: CheckpointLayout | None = None
    snapshot: dict[str, ModuleSnapshot] | None = None
    proof: Proof | None = None
    refreshers: dict[str, Refresher] = field(default_factory=dict)
    reprocessable: set[str] = field(default_factory=set)
    undefined: str | None = None
    writing: bool = False
    plan_cache: tuple[Any, Any] | None = None
    write_map: WriteMap | None = None
    fingerprints: dict[str, int] = field(default_factory=dict)
    writes: int = 0


def bridge_state(model: torch.nn.Module) -> BridgeState:
    """The model's bridge state, created empty on first use."""
    state = model.__dict__.get(STATE_ATTR)
    if state is None:
        state = BridgeState()
        model.__dict__[STATE_ATTR] = state
    return state


def undefined_reason(model: torch.nn.Module) -> str | None:
    """Why the model's weights are undefined (a reload failed mid-way), or None."""
    return bridge_state(model).undefined


def mark_undefined(model: torch.nn.Module, reason: str) -> None:
    """Flag the weights as half-written until a complete reload succeeds."""
    bridge_state(model).undefined = reason


def clear_undefined(model: torch.nn.Module) -> None:
    """Declare the weights whole again (a complete reload by another path succeeded)."""
    bridge_state(model).undefined = None


def note_written(model: torch.nn.Module) -> None:
    """A write of the model's weights ended (whatever it wrote, however it ended): every copy
    of them dated before is out of date. Called where every write passes: the end of a write
    session (:mod:`.session`) and of every phase of an engine's update that may write
    (:mod:`weight_bridge.vllm.worker.transaction`), so no writer has to remember it."""
    bridge_state(model).writes += 1
