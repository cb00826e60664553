"""Direct reload: write a checkpoint straight into a model's live storages, in place.

The model's parameters are temporarily re-pointed at views, in checkpoint layout, of the
storages they live in *now*; the model's own loading path (``load_weights`` with its fused
qkv / gate_up loaders, tensor-parallel narrowing and tied names) then writes through those views,
and the original views are restored. Nothing is re-allocated and post-load processing is not
re-run, so every address stays put (CUDA graphs stay valid).

One push, in order: :mod:`.validate` (the whole checkpoint against the layout recorded at load)
-> :mod:`.plan` (each name resolved by :mod:`.resolve` and proven by :mod:`.proof`) ->
:mod:`.session` (write through the views, read every write back with :mod:`.readback`, hand
unprovable modules to the engine's re-processing, refresh derived state, audit addresses).

Limitations:
1. Derived state is refreshed only where a :class:`Refresher` says how; other derived state is
   re-processed by the engine's own path or refused by name (see :mod:`.proof`).
2. A storage freed and re-allocated at the same address with the same size is taken as unchanged.
3. Names are checked against the checkpoint recorded at load; a loader that maps names
   differently on reload than on load is not detected.
4. The read-back sees writes made through ``Tensor.copy_`` (every loader in vLLM and torch's own
   ``load_state_dict``); writes by indexing assignment are not read back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

import torch

from .errors import DirectReloadError, NotDirectlyReloadable
from .plan import ReloadPlan, plan_direct_reload, require_layout
from .proof import Proof, Refresher, prove_checkpoint_layout
from .readback import READBACK_MODES
from .resolve import Relocation, ResolvedTarget, resolve_target
from .session import (
    OpenReload,
    ReloadReport,
    Reprocessor,
    begin_direct_reload,
    clear_undefined,
    direct_reload_session,
    finish_direct_reload,
    mark_undefined,
    undefined_reason,
)
from .validate import check_finite, preflight, validate_checkpoint

__all__ = [
    "READBACK_MODES",
    "DirectReloadError",
    "NotDirectlyReloadable",
    "OpenReload",
    "Proof",
    "Refresher",
    "ReloadPlan",
    "ReloadReport",
    "Relocation",
    "Reprocessor",
    "ResolvedTarget",
    "begin_direct_reload",
    "check_finite",
    "clear_undefined",
    "direct_reload",
    "direct_reload_session",
    "finish_direct_reload",
    "mark_undefined",
    "plan_direct_reload",
    "preflight",
    "prove_checkpoint_layout",
    "resolve_target",
    "undefined_reason",
    "validate_checkpoint",
]

Weights = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def _copy_by_name(plan: ReloadPlan) -> Callable[[Iterable[tuple[str, torch.Tensor]]], None]:
    def load(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in weights:
            plan.targets[name].view.copy_(t)

    return load


def direct_reload(
    model: torch.nn.Module,
    weights: Weights,
    load: Callable[[Iterable[tuple[str, torch.Tensor]]], object] | None = None,
    finite: bool = True,
    reprocessor: Reprocessor | None = None,
    reprocessable: set[str] | frozenset[str] = frozenset(),
    readback: str = "sampled",
    partial: bool = False,
) -> ReloadReport:
    """Write ``weights`` into ``model``'s live storages: validate, plan, write, prove, refresh.

    ``load`` receives an iterable of ``(name, tensor)``; by default the model's own
    ``load_weights`` if it has one, else a copy by name. The whole checkpoint is checked against
    the recorded layout (names, shapes, dtypes, and NaN/Inf when ``finite``) and every name is
    resolved and proven before the first write. A failure after writing started marks the model
    undefined and raises :class:`DirectReloadError` (an interrupt such as ``KeyboardInterrupt``
    propagates as itself, the model likewise undefined). ``reprocessor`` handles the modules of
    ``reprocessable`` that cannot be written directly; ``readback`` is ``"sampled"``,
    ``"full"`` or ``"off"``. ``partial`` weights (a subset, applied on top of what the model
    holds) may leave names out; only the modules they write into are refreshed, and a partial
    push that would need re-processing by the engine is refused.
    """
    started = time.perf_counter()
    layout = require_layout(model)
    items = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
    validate_checkpoint(layout, items, finite, partial)
    preflight_s = time.perf_counter() - started
    try:
        with direct_reload_session(model, reprocessor, reprocessable, readback, partial) as reload:
            if load is None:
                own = getattr(model, "load_weights", None)
                load = own if callable(own) else _copy_by_name(reload.plan)
            load(reload.readback.track(items))
    except DirectReloadError:
        raise
    except Exception as exc:
        raise DirectReloadError(undefined_reason(model) or str(exc)) from exc
    report = reload.report
    assert report is not None
    report.tensors = len(items)
    report.bytes = sum(t.numel() * t.element_size() for _, t in items)
    report.preflight_s = preflight_s
    report.elapsed_s = time.perf_counter() - started
    return report
