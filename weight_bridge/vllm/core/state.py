"""What a bridged engine core remembers between the calls of an update (one record per core,
kept on the core: :func:`~weight_bridge.vllm.internals.objects.bridge_state_of`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..internals.objects import bridge_state_of


@dataclass
class ActiveUpdate:
    """The update between its ``start_weight_update`` and its end."""

    since: float  # time.time() of its start
    last_call: float  # time.monotonic() of its last call
    version: str | None = None  # what its update_weights asked to stamp


@dataclass
class BridgeCoreState:
    """What the engine core remembers between the calls of an update."""

    failed: str | None = None  # the last update failed: its finish is refused
    undefined: str | None = None  # a rank's weights are half-written: nothing is scheduled
    paused_before: Any = None  # the scheduler's pause state before the bridge paused it
    updates: int = 0
    report: dict | None = None  # the last update's PushReport, as a dict (None: none yet)
    active: ActiveUpdate | None = None
    conflict: dict | None = None  # the last refused start's UpdateInProgressError, as a dict
    # the adapter versions in the LoRA slots, rebuilt at each successful update (.adapters)
    adapters: dict[str, dict] = field(default_factory=dict)


def core_state(core: Any) -> BridgeCoreState:
    """The bridge's record on ``core`` (made on first use)."""
    return bridge_state_of(core, BridgeCoreState)
