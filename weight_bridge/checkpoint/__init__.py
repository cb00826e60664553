"""Safetensors checkpoints: streamed, atomic, hashed, owner-only writes; validated, zero-copy
reads.

Reads never unpickle and never trust the file: the header is parsed and checked (size bounds,
dtypes, shapes against byte ranges, ranges inside the file, no duplicate names) before any
tensor is touched, and tensors are handed out as views of a private memory map, so a push reads
each byte once, from the page cache straight into the engine's storage. Each file is opened
once: its header is read from, and its map made of, the same open file, so a file renamed over
the path in between cannot pair one file's header with another's bytes. A file that is not
safetensors (a ``torch.save`` zip or pickle renamed, say) is refused by its first bytes.

Writes are streamed (the header from shapes and dtypes first, then one tensor at a time, so a
sharded trainer never holds the whole model), atomic (a temporary file renamed into place),
owner-only and hashed; how, and what a failed or killed writer leaves behind: :mod:`.write`.

Limitation: a file that another program truncates *in place* while an engine has it mapped
makes the engine's next read of the lost pages fault (SIGBUS); only rename-into-place writers
(like :func:`save_checkpoint`) are safe to run beside a push.

Modules: :mod:`.errors` (the exceptions), :mod:`.format` (dtype names, limits, the content
hash), :mod:`.header` (one file's header parsed and mapped), :mod:`.read` (shard index,
:class:`CheckpointReader`), :mod:`.write` (:class:`CheckpointWriter`, :func:`save_checkpoint`),
:mod:`.header_plan` (the header a writer plans from metadata), :mod:`.space` (the writer's
filesystem calls), :mod:`.mapping` (the writer's maps of its files, kept across syncs),
:mod:`.retention` (where a sync's files go, their names, which may be deleted:
:class:`CheckpointFiles`, :func:`step_file`), :mod:`.sender` (one sync, the same for the
callback and vLLM's trainer API: :class:`Sender`), :mod:`.live` (tensors published in this
process, pushed by name into an engine in the trainer's own process: no file).
Tests that inject faults patch the module that looks the name up
(``weight_bridge.checkpoint.write`` for the writer).
"""

from __future__ import annotations

from .delta_choice import DeltaChoice, host_memory_transport
from .delta_sink import OpenSink, Sink
from .delta_state import DeltaState
from .errors import CheckpointError, CheckpointWriteError
from .format import BASE_VERSION_KEY, HASH_KEY, VERSION_KEY, version_of
from .format import DTYPE_NAMES as DTYPE_NAMES
from .format import DTYPES as DTYPES
from .format import INDEX_NAME as INDEX_NAME
from .format import MAX_HEADER_BYTES as MAX_HEADER_BYTES
from .format import MAX_INDEX_BYTES as MAX_INDEX_BYTES
from .keyframes import EngineDtypes, KeyframeClock, castable_dtype, delta_mode
from .live import LiveSink, is_live, published
from .mapping import TransportMaps
from .read import CheckpointReader, resolve_checkpoint_files
from .retention import (
    SPARE,
    CheckpointFiles,
    discard,
    estimate_bytes,
    make_dir,
    place,
    prune,
    release,
    step_file,
)
from .run_dirs import claim
from .sender import Sender, Sent, Turn, Written
from .space import create_reserved
from .write import STALE_TEMP_AGE_S as STALE_TEMP_AGE_S
from .write import CheckpointWriter, SavedCheckpoint, save_checkpoint

__all__ = [
    "BASE_VERSION_KEY",
    "HASH_KEY",
    "VERSION_KEY",
    "CheckpointError",
    "CheckpointFiles",
    "CheckpointReader",
    "CheckpointWriteError",
    "CheckpointWriter",
    "SavedCheckpoint",
    "resolve_checkpoint_files",
    "save_checkpoint",
    "step_file",
    "version_of",
    # the trainer side's files: where they go, which may go (the callback's and the trainer
    # API's; :mod:`.retention`, :mod:`.run_dirs`, :mod:`.space`, :mod:`.mapping`)
    "SPARE",
    "TransportMaps",
    "claim",
    "create_reserved",
    "discard",
    "estimate_bytes",
    "make_dir",
    "place",
    "prune",
    "release",
    # the trainer side's one sender (:mod:`.sender`) and its deltas (:mod:`.delta_state`,
    # :mod:`.keyframes`, :mod:`.delta_choice`, :mod:`.delta_sink`)
    "Sender",
    "Sent",
    "Turn",
    "Written",
    "DeltaChoice",
    "DeltaState",
    "EngineDtypes",
    "KeyframeClock",
    "OpenSink",
    "Sink",
    "castable_dtype",
    "delta_mode",
    "host_memory_transport",
    # tensors pushed from memory into an engine in the trainer's process (:mod:`.live`)
    "LiveSink",
    "is_live",
    "published",
]
