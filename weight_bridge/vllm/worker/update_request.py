"""The ``update_info`` of vLLM's ``update_weights`` for the bridge's backend, as each worker
parses it, and the update a worker prepares from it."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from ...checkpoint.live import LiveCheckpoint
from ...checkpoint.read import CheckpointSource
from ...direct.writer import Writer


@dataclass
class UpdateRequest:
    """``update_weights({"update_info": {...}})`` for the ``weight_bridge`` backend.

    ``checkpoint``: a safetensors file or a directory of shards, under the engine's checkpoint
    root (a relative path is taken relative to it), or, from a client in the engine's own
    process, a :class:`~weight_bridge.checkpoint.live.LiveCheckpoint` (the object itself).
    ``verify_hash`` / ``check_finite``: override the engine's options for this update.
    ``version``: the weight version the engine stamps on every output token computed with these
    weights, from the engine step that first runs them on (the engine core stamps it in the same
    call that writes them; default: the checkpoint's ``version`` metadata, else its file name).
    ``served_version``: the version the engine serves, filled in by the engine core (vLLM keeps
    it there); a partial checkpoint's ``base_version`` must equal it.
    """

    checkpoint: str | LiveCheckpoint
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


@dataclass
class PreparedUpdate:
    """A prepared update: the open checkpoint, its writer, and every header field the write's
    bookkeeping needs, parsed at prepare (nothing is parsed after the first byte is written)."""

    reader: CheckpointSource
    items: list[tuple[str, Any]]  # tensors, or LiveTensor descriptions
    writer: Writer
    path: str
    partial: bool
    pre_images: bool = False  # its writer keeps what it replaces: held only while the update runs
    fingerprints: dict[str, int] = field(default_factory=dict)  # the header's, parsed
    lineage: str | None = None  # of what is served once it is written
    started: bool = False  # its writer was called: bytes may have been written
    ran: bool = False  # its writer returned: the new bits are written, the model defined
