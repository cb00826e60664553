"""Safetensors checkpoints: streamed, atomic, hashed, owner-only writes; validated, zero-copy
reads. What an update reads and writes, the file format and its sources, and nothing of the
trainer's sync policy (that is :mod:`weight_bridge.sync`; deltas: :mod:`weight_bridge.delta`).

Reads never unpickle and never trust the file (:mod:`.read`, :mod:`.header`: checked before any
tensor is touched, each file opened once, handed out as views of a private map); writes:
:mod:`.write` (streamed, atomic, owner-only, hashed; what a failed writer leaves). Only
rename-into-place writers are safe beside a push (:mod:`.read`'s limitation).

Modules: :mod:`.errors` (the exceptions), :mod:`.format` (dtype names, limits, the content
hash), :mod:`.header` (one file's header parsed and mapped), :mod:`.read` (shard index,
:class:`CheckpointReader`), :mod:`.write` (:class:`CheckpointWriter`, :func:`save_checkpoint`),
:mod:`.header_plan` (the header a writer plans from metadata), :mod:`.space` (the writer's
filesystem calls), :mod:`.mapping` (the writer's maps of its files, kept across syncs),
:mod:`.trust` (the checkpoint root), :mod:`.held` (a file an engine holds), :mod:`.live`
(tensors in this process, pushed as they are into an engine in the trainer's own process: no
file), :mod:`.dtensor` (a DTensor gathered one tensor at a time).
Tests that inject faults patch the module that looks the name up
(``weight_bridge.checkpoint.write`` for the writer).
"""

from __future__ import annotations

from .errors import CheckpointError, CheckpointWriteError
from .format import BASE_VERSION_KEY, version_of
from .mapping import TransportMaps
from .read import CheckpointReader
from .space import create_reserved
from .write import CheckpointWriter, SavedCheckpoint, save_checkpoint

__all__ = [
    # a checkpoint: written, read, refused, versioned
    "CheckpointError",
    "CheckpointReader",
    "CheckpointWriteError",
    "CheckpointWriter",
    "SavedCheckpoint",
    "save_checkpoint",
    "version_of",
    "BASE_VERSION_KEY",
    # the writer's space: its maps of its files, kept across syncs, and its reserved files
    "TransportMaps",
    "create_reserved",
]
