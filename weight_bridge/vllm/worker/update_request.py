"""The ``update_info`` of vLLM's ``update_weights`` for the bridge's backend, as each worker
parses it."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

__all__ = ["UpdateRequest"]


@dataclass
class UpdateRequest:
    """``update_weights({"update_info": {...}})`` for the ``weight_bridge`` backend.

    ``checkpoint``: a safetensors file or a directory of shards, under the engine's checkpoint
    root (a relative path is taken relative to it). ``verify_hash`` / ``check_finite``: override
    the engine's options for this update. ``version``: the weight version the engine stamps on
    every output token computed with these weights, from the engine step that first runs them on
    (the engine core stamps it in the same call that writes them; default: the checkpoint's
    ``version`` metadata, else its file name). ``served_version``: the version the engine
    serves, filled in by the engine core (vLLM keeps it there); a partial checkpoint's
    ``base_version`` must equal it.
    """

    checkpoint: str
    verify_hash: bool | None = None
    check_finite: bool | None = None
    version: str | None = None
    served_version: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> UpdateRequest:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown or "checkpoint" not in data:
            raise ValueError(
                f"weight_bridge update_info takes {sorted(known)} (checkpoint required), "
                f"got {sorted(data)}"
            )
        return cls(**data)
