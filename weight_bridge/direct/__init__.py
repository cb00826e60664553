"""Direct reload: write a checkpoint straight into a model's live storages, in place.

The model's parameters are temporarily re-pointed at views, in checkpoint layout, of the
storages they live in *now*; the model's own loading path (``load_weights`` with its fused
qkv / gate_up loaders, tensor-parallel narrowing and tied names) then writes through those views,
and the original views are restored. Nothing is re-allocated and post-load processing is not
re-run, so every address stays put (CUDA graphs stay valid).

One push, in order (each module imports only the ones before it): :mod:`.snapshot` and
:mod:`.proof` (what processing did, computed by :mod:`.record` at load) -> :mod:`.validate`
(the whole checkpoint against the recorded layout) -> :mod:`.plan` (each name resolved by
:mod:`.resolve` and proven) -> :mod:`.session` (write through the views, read every write back
with :mod:`.readback`, hand unprovable modules to the engine's re-processing, refresh derived
state, audit addresses). The per-model state lives in :mod:`.state`; :mod:`.parallel` splits
the independent jobs of a push (the finiteness pass, concurrent refreshers) across threads.

Public API, in tiers: what a user calls (:func:`record_checkpoint_layout` at load,
:func:`prove_checkpoint_layout` after processing, :func:`direct_reload` or
:func:`direct_reload_session` per push, :func:`plan_direct_reload` for a dry run) and what they
return; the extension points (:class:`Refresher`, :class:`Reprocessor`); everything else
under its module (:class:`.session.PreparedReload`, :class:`.session.OpenReload`,
:class:`.proof.Proof`, ...).

Limitations: docs/limitations.md.
"""

from __future__ import annotations

from .errors import DirectReloadError
from .extension import Refresher, Reprocessor
from .plan import ReloadPlan, plan_direct_reload
from .record import prove_checkpoint_layout, record_checkpoint_layout
from .report import ReloadReport
from .session import direct_reload, direct_reload_session, prepare_direct_reload

__all__ = [
    # what a user calls, and what it returns
    "record_checkpoint_layout",
    "prove_checkpoint_layout",
    "direct_reload",
    "direct_reload_session",
    "prepare_direct_reload",
    "plan_direct_reload",
    "DirectReloadError",
    "ReloadPlan",
    "ReloadReport",
    # extension points
    "Refresher",
    "Reprocessor",
]
