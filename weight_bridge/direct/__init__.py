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

Limitations:
1. Derived state is refreshed only where a :class:`Refresher` says how; other derived state is
   re-processed by the engine's own path or refused by name (see :mod:`.proof`).
2. A storage freed and re-allocated at the same address with the same size is taken as unchanged.
3. Names are checked against the checkpoint recorded at load; a loader that maps names
   differently on reload than on load is not detected.
4. The read-back compares writes made through ``Tensor.copy_`` (every loader in vLLM and torch's
   own ``load_state_dict``); other in-place writes count as written but are not compared.
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
