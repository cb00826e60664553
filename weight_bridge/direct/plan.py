"""A dry run of a direct reload: every name resolved and proven, or refused, nothing written.

A plan depends only on what was recorded at load, the proof, the refreshers and where every
tensor lives now. The last plan is kept on the model with the addresses it was computed for
(:func:`~.snapshot.addresses`, which every reload takes anyway for its audit): a push into a
model whose addresses did not change (the normal case: a direct reload never moves one)
reuses it instead of resolving and proving every weight again.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from ..layout import byte_span, live_tensors, storage_ptr
from .errors import NotDirectlyReloadable
from .proof import module_of, write_tensor
from .record import ensure_proof, require_layout
from .resolve import Relocation, ResolvedTarget, overlapping_targets, resolve_target, signature
from .snapshot import Addresses, addresses
from .state import bridge_state


@dataclass
class ReloadPlan:
    """What a direct reload would do, per name and per module.

    ``targets``: names written directly, with their views. ``problems``: names refused, why.
    ``refresh``: module -> kind of derived state re-derived after the write.
    ``reprocess``: module -> why it is handed to the engine's own per-layer processing instead
    (only when the caller can re-process, see :func:`plan_direct_reload`).
    """

    targets: dict[str, ResolvedTarget]
    problems: dict[str, str]
    refresh: dict[str, str] = field(default_factory=dict)
    reprocess: dict[str, str] = field(default_factory=dict)

    @property
    def relocations(self) -> list[Relocation]:
        return [t.relocation for t in self.targets.values() if t.relocation is not None]

    @functools.cached_property
    def spans(self) -> dict[str, tuple[int, int]]:
        """Name -> the bytes its target view covers (computed once per plan: a cached plan
        is reused only while no address changed)."""
        return {name: byte_span(t.view) for name, t in self.targets.items()}

    @functools.cached_property
    def storages(self) -> frozenset[int]:
        """The storages the targets live in (what the read-back watches)."""
        return frozenset(storage_ptr(t.view) for t in self.targets.values())


def plan_direct_reload(
    model: torch.nn.Module,
    reprocessable: set[str] | frozenset[str] = frozenset(),
    now: Addresses | None = None,
) -> ReloadPlan:
    """Resolve and prove every recorded name without writing anything.

    A name is written directly only if its resolved view is the one proven at load to hold the
    checkpoint's values and its module has no derived state that no refresher accounts for.
    Modules in ``reprocessable`` (those the caller can hand to the engine's own per-layer
    processing) that fail either test are planned for re-processing instead of refused.
    ``now``: the model's :func:`~.snapshot.addresses`, if the caller has them already.
    """
    state = bridge_state(model)
    proof = ensure_proof(model)
    key = (addresses(model) if now is None else now, frozenset(reprocessable), id(proof))
    if state.plan_cache is not None and state.plan_cache[0] == key:
        return state.plan_cache[1]
    plan = _plan(model, frozenset(reprocessable))
    state.plan_cache = (key, plan)
    return plan


def _plan(model: torch.nn.Module, reprocessable: frozenset[str]) -> ReloadPlan:
    layout = require_layout(model)
    state = bridge_state(model)
    proof = ensure_proof(model)
    unproven = proof.unproven_modules()
    live = {name: t for name, t, _ in live_tensors(model)}
    targets: dict[str, ResolvedTarget] = {}
    problems: dict[str, str] = {}
    reprocess: dict[str, str] = {}
    for name, entry in layout.tensors.items():
        if entry.is_buffer and name not in layout.checkpoint:
            continue  # derived buffers (rotary caches...) are never written by a reload
        module, _ = module_of(name)
        why = None
        if name not in live:
            why = "no longer exists in the model"
        else:
            try:
                target = resolve_target(entry, write_tensor(state.refreshers, name, live[name]))
            except NotDirectlyReloadable as exc:
                why = str(exc)
            else:
                if module in unproven:
                    why = proof.transformed.get(name) or f"its module has {unproven[module]}"
                elif entry.fingerprint is not None and proof.targets.get(name) != signature(
                    target.view
                ):
                    why = "write target is not the view proven at load to hold its values"
                else:
                    targets[name] = target
        if why is None:
            continue
        if module in reprocessable:
            reprocess[module] = unproven.get(module, why)
        else:
            problems[name] = why
    for name in [n for n in targets if module_of(n)[0] in reprocess]:
        del targets[name]  # a re-processed module is loaded whole by the engine's own path
    problems.update(overlapping_targets(targets, layout.aliases()))
    touched = {module_of(n)[0] for n in targets}
    refresh = {m: r.kind for m, r in state.refreshers.items() if m in touched}
    return ReloadPlan(targets, problems, refresh, reprocess)
