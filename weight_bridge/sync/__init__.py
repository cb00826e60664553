"""The trainer side of a sync, shared by the Lightning callback (:mod:`callbacks`) and vLLM's
trainer API (:class:`~weight_bridge.vllm.clients.trainer_api.WeightBridgeTrainer`).

:mod:`.sender` (one sync, the same for both: :class:`Sender`), :mod:`.retention` (where a sync's
files go, their names, which may be deleted: :class:`CheckpointFiles`, :func:`step_file`),
:mod:`.run_dirs` (a run's private directory, claimed while the run lives, removed after); the
callback's sync: :mod:`.transport` (how the tensors travel, the push and the canary:
:mod:`.canary`), :mod:`.gather` (what is sent, each tensor to the writer: :mod:`.changed`,
:mod:`.names`) and :mod:`.collective` (each step agreed by every rank).
Layering: this package imports :mod:`weight_bridge.checkpoint`, :mod:`weight_bridge.delta`,
:mod:`weight_bridge.layout` and :mod:`weight_bridge.errors`, and calls nothing of the callback's
(it is handed the trainer's objects and the engine client); nothing on the engine's side
imports it.
"""

from __future__ import annotations

from .retention import SPARE, CheckpointFiles, discard, estimate_bytes, prune, release, step_file
from .sender import Sender, Turn, Written

__all__ = [
    # the one sender and the kind of each sync
    "Sender",
    "Turn",
    "Written",
    # the file policy: where, under which name, what is kept
    "CheckpointFiles",
    "SPARE",
    "discard",
    "estimate_bytes",
    "prune",
    "release",
    "step_file",
]
