"""The trainer side of a sync, shared by the Lightning callback (:mod:`callbacks`) and vLLM's
trainer API (:class:`~weight_bridge.vllm.clients.trainer_api.WeightBridgeTrainer`).

:mod:`.sender` (one sync, the same for both: :class:`Sender`), :mod:`.retention` (where a sync's
files go, their names, which may be deleted: :class:`CheckpointFiles`, :func:`step_file`),
:mod:`.run_dirs` (a run's private directory, claimed while the run lives, removed after).
Layering: this package imports :mod:`weight_bridge.checkpoint`, :mod:`weight_bridge.delta`,
:mod:`weight_bridge.exact` and :mod:`weight_bridge.layout`; nothing on the engine's side
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
