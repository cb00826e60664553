"""Safetensors checkpoints: streamed, atomic, hashed, owner-only writes; validated, zero-copy
reads.

Reads never unpickle and never trust the file (:mod:`.read`, :mod:`.header`: checked before any
tensor is touched, each file opened once, handed out as views of a private map); writes:
:mod:`.write` (streamed, atomic, owner-only, hashed; what a failed writer leaves). Only
rename-into-place writers are safe beside a push (:mod:`.read`'s limitation).

Modules: :mod:`.errors` (the exceptions), :mod:`.format` (dtype names, limits, the content
hash), :mod:`.header` (one file's header parsed and mapped), :mod:`.read` (shard index,
:class:`CheckpointReader`), :mod:`.write` (:class:`CheckpointWriter`, :func:`save_checkpoint`),
:mod:`.header_plan` (the header a writer plans from metadata), :mod:`.space` (the writer's
filesystem calls), :mod:`.mapping` (the writer's maps of its files, kept across syncs),
:mod:`.retention` (where a sync's files go, their names, which may be deleted:
:class:`CheckpointFiles`, :func:`step_file`), :mod:`.sender` (one sync, the same for the
callback and vLLM's trainer API: :class:`Sender`), :mod:`.live` (tensors in this process,
pushed as they are into an engine in the trainer's own process: no file).
Tests that inject faults patch the module that looks the name up
(``weight_bridge.checkpoint.write`` for the writer).
"""

from __future__ import annotations

from .delta_sink import OpenSink, Sink
from .delta_state import DeltaState
from .errors import CheckpointError, CheckpointWriteError
from .format import BASE_VERSION_KEY, version_of
from .keyframes import EngineDtypes
from .mapping import TransportMaps
from .read import CheckpointReader
from .retention import SPARE, CheckpointFiles, discard, estimate_bytes, prune, release, step_file
from .sender import Sender, Turn, Written
from .space import create_reserved
from .write import CheckpointWriter, SavedCheckpoint, save_checkpoint

__all__ = [
    # a checkpoint: written, read, refused, versioned
    "CheckpointError",
    "CheckpointFiles",
    "CheckpointReader",
    "CheckpointWriteError",
    "CheckpointWriter",
    "SavedCheckpoint",
    "save_checkpoint",
    "step_file",
    "version_of",
    "BASE_VERSION_KEY",
    # the trainer side's one sender, its files and its sinks (what the callback uses of
    # :mod:`.sender`, :mod:`.retention`, :mod:`.space`, :mod:`.mapping`, :mod:`.delta_state`,
    # :mod:`.keyframes`, :mod:`.delta_sink`); the rest under its module
    "Sender",
    "Turn",
    "Written",
    "SPARE",
    "TransportMaps",
    "create_reserved",
    "discard",
    "estimate_bytes",
    "prune",
    "release",
    "DeltaState",
    "EngineDtypes",
    "OpenSink",
    "Sink",
]
