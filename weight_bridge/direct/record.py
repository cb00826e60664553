"""Recording a model at load and proving it after post-load processing; kept on the model.

:func:`record_checkpoint_layout` runs right after the weights are loaded (layout, fingerprints
and a snapshot of every module); :func:`prove_checkpoint_layout` after post-load processing
(what processing moved, transformed or derived). Both keep what they computed in the model's
:class:`~.state.BridgeState`, where every later reload reads it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..layout import CheckpointLayout, TensorLayout, TensorSpec, live_tensors
from .errors import DirectReloadError
from .extension import Refresher
from .proof import Proof, compute_proof
from .snapshot import snapshot_modules
from .state import bridge_state

_NO_LAYOUT = (
    "no checkpoint layout recorded on this model: call record_checkpoint_layout(model) "
    "right after its weights are first loaded"
)


def record_checkpoint_layout(
    model: torch.nn.Module,
    checkpoint: Mapping[str, TensorSpec] | None = None,
    optional: frozenset[str] | set[str] = frozenset(),
) -> CheckpointLayout:
    """Record every parameter/buffer's layout and fingerprint on ``model``; return the record.

    Call it right after the weights are loaded and before post-load processing: the
    fingerprints and a snapshot of every module's state taken here are what the first direct
    reload (or :func:`prove_checkpoint_layout`) compares the processed model with.
    ``checkpoint`` names the tensors a checkpoint must hold; by default the parameter and
    buffer names themselves (the case of a plain module loaded by name). ``optional`` names
    checkpoint tensors that may be absent (e.g. non-persistent buffers). A complete reload
    must write each name of ``checkpoint`` again, and a buffer is fingerprinted only where the
    checkpoint carries it (a computed buffer, such as rotary tables, is not the checkpoint's).
    """
    loaded = set(checkpoint) if checkpoint is not None else None
    tensors = {}
    for name, t, is_buffer in live_tensors(model):
        prove = not is_buffer or loaded is None or name in loaded
        tensors[name] = TensorLayout.of(name, t, is_buffer, prove=prove)
    if checkpoint is None:
        checkpoint = {n: TensorSpec(e.shape, e.dtype) for n, e in tensors.items()}
    layout = CheckpointLayout(
        tensors=tensors,
        checkpoint=dict(checkpoint),
        optional=frozenset(optional),
        loaded=frozenset(loaded) if loaded is not None else None,
    )
    state = bridge_state(model)
    state.layout = layout
    state.snapshot = snapshot_modules(model)
    state.proof = None
    state.plan_cache = None
    return layout


def require_layout(model: torch.nn.Module) -> CheckpointLayout:
    """The layout recorded on ``model``; refused by name if none was."""
    layout = bridge_state(model).layout
    if layout is None:
        raise DirectReloadError(_NO_LAYOUT)
    return layout


def prove_checkpoint_layout(
    model: torch.nn.Module, refreshers: Mapping[str, Refresher] | None = None
) -> Proof:
    """Compare the processed ``model`` with what was recorded at load; keep and return the proof.

    Call it after post-load processing (a direct reload calls it on first use otherwise).
    ``refreshers`` (module name -> :class:`~.extension.Refresher`) declare derived state the
    caller can re-derive; their ``sources`` become those weights' write targets.
    """
    state = bridge_state(model)
    if state.layout is None or state.snapshot is None:
        raise DirectReloadError(_NO_LAYOUT)
    if refreshers:
        state.refreshers.update(refreshers)
    state.proof = compute_proof(model, state.layout, state.snapshot, state.refreshers)
    state.plan_cache = None
    return state.proof


def ensure_proof(model: torch.nn.Module) -> Proof:
    """The model's proof, computed now if it was not yet (first reload after processing)."""
    state = bridge_state(model)
    return state.proof if state.proof is not None else prove_checkpoint_layout(model)
