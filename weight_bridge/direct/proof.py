"""Proof that a direct write reaches what the model computes with.

A weight is *directly writable* when the view its checkpoint tensor resolves to (see
:mod:`.resolve`) still holds, after post-load processing, exactly the values the loader wrote:
then processing only moved or re-viewed it, and writing the next checkpoint there is what a cold
start would have computed. Two things break that, and both are detected here, per name and per
module, before anything is written:

* **Transformed values.** Processing transposed, rescaled, shuffled or prepacked the weight
  (same shape and dtype, so the resolution rule alone cannot tell). The fingerprint of the
  resolved view differs from the one taken at load.
* **Derived state.** Processing created or replaced, on a module, a tensor that is not a view of
  a weight (a packed copy, a transposed copy, a scale) or a kernel object (a packed handle in a
  closure). A write into the weight does not reach it.

A :class:`~.extension.Refresher` (registered by the engine integration for state it knows how
to re-derive: the CPU backend's packed linears and prepacked MoE experts) turns such a module
into one that is written directly and then refreshed. What is neither proven nor refreshable
must be re-processed by the engine's own path or refused by name.

This module computes a proof from what it is given; keeping it on the model is
:mod:`.record`'s job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..layout import CheckpointLayout, fingerprint, live_tensors, storage_ptr
from .errors import NotDirectlyReloadable
from .extension import Refresher
from .resolve import resolve_target, signature
from .snapshot import ModuleSnapshot, snapshot_module


def module_of(name: str) -> tuple[str, str]:
    """``"a.b.weight"`` -> ``("a.b", "weight")``."""
    module, _, attr = name.rpartition(".")
    return module, attr


@dataclass
class Proof:
    """What post-load processing did to each weight and module, as far as a write is concerned.

    ``transformed``: name -> why its resolved view no longer holds the checkpoint's values.
    ``derived``: module name -> its derived state that no refresher accounts for. Derived
    tensors found on a module that holds no weight (an attention layer holding matrices
    absorbed from a sibling projection) count against every weight under its parent.
    ``noted``: module name -> state created by processing on modules holding no weight that
    cannot hold weight values (kernel objects built from the configuration, scalars): shown by
    ``explain``, not blocking.
    ``targets``: name -> :func:`~.resolve.signature` of the view proven to hold its values.
    """

    transformed: dict[str, str] = field(default_factory=dict)
    derived: dict[str, list[str]] = field(default_factory=dict)
    noted: dict[str, list[str]] = field(default_factory=dict)
    targets: dict[str, tuple] = field(default_factory=dict)

    def unproven_modules(self) -> dict[str, str]:
        """Module name -> why some of its state cannot be written directly."""
        out: dict[str, list[str]] = {}
        for name, why in self.transformed.items():
            out.setdefault(module_of(name)[0], []).append(f"{module_of(name)[1]} {why}")
        for module, items in self.derived.items():
            out.setdefault(module, []).append("derived state " + ", ".join(items))
        return {m: "; ".join(reasons) for m, reasons in out.items()}


def write_tensor(
    refreshers: Mapping[str, Refresher], name: str, live: torch.Tensor
) -> torch.Tensor:
    """The tensor a write of ``name`` goes into: a refresher's source, else the live one."""
    module, attr = module_of(name)
    refresher = refreshers.get(module)
    if refresher is not None and attr in refresher.sources:
        return refresher.sources[attr]
    return live


def _derived_items(
    before: ModuleSnapshot, after: ModuleSnapshot, recorded: set[str], weights: set[int]
) -> list[tuple[str, bool]]:
    """``(description, could hold weight values)`` of what processing created or replaced."""
    items = []
    for attr, entry in sorted(after.items()):
        if attr in recorded or before.get(attr) == entry:
            continue
        kind, _, ptr, _, numel = entry
        if kind == "tensor":
            if ptr == 0 or ptr in weights:
                continue  # empty, or a view of a weight: a write reaches it
            items.append((f"{attr} (a tensor computed from the weights)", numel > 1))
        else:
            items.append((f"{attr} (a kernel object)", False))
    return items


def _prove_values(
    layout: CheckpointLayout,
    live: dict[str, torch.Tensor],
    refreshers: Mapping[str, Refresher],
    proof: Proof,
) -> None:
    """Per weight: does the view a write resolves to still hold the values the loader wrote?"""
    for name, entry in layout.tensors.items():
        if entry.fingerprint is None or name not in live:
            continue
        try:
            view = resolve_target(entry, write_tensor(refreshers, name, live[name])).view
        except NotDirectlyReloadable:
            continue  # the plan refuses it with the resolution's own reason
        if entry.fingerprint.matches(fingerprint(view)):
            proof.targets[name] = signature(view)
        else:
            proof.transformed[name] = (
                "values changed by post-load processing (transformed, not only moved: "
                "a write in checkpoint layout would not be what the model computes with)"
            )


def _prove_modules(
    model: torch.nn.Module,
    layout: CheckpointLayout,
    snapshot: Mapping[str, ModuleSnapshot],
    refreshers: Mapping[str, Refresher],
    weights: set[int],
    proof: Proof,
) -> None:
    """Per module: what did processing create or replace that a write would not reach?"""
    recorded_by_module: dict[str, set[str]] = {}
    for name, entry in layout.tensors.items():
        if entry.fingerprint is not None:  # a weight a checkpoint writes
            module, attr = module_of(name)
            recorded_by_module.setdefault(module, set()).add(attr)
    for module_name, module in model.named_modules():
        refresher = refreshers.get(module_name)
        recorded = recorded_by_module.get(module_name, set())
        if refresher is not None:
            recorded = recorded | refresher.explains
        before = snapshot.get(module_name, {})
        items = _derived_items(before, snapshot_module(module), recorded, weights)
        if not items:
            continue
        if module_name in recorded_by_module:
            proof.derived.setdefault(module_name, []).extend(i for i, _ in items)
            continue
        heavy = [i for i, weighty in items if weighty]
        light = [i for i, weighty in items if not weighty]
        if light:
            proof.noted[module_name] = light
        parent = module_name.rpartition(".")[0]
        for owner in recorded_by_module if heavy else ():
            if not parent or owner.startswith(parent + "."):
                proof.derived.setdefault(owner, []).extend(f"{module_name}.{i}" for i in heavy)


@torch.no_grad()
def compute_proof(
    model: torch.nn.Module,
    layout: CheckpointLayout,
    snapshot: Mapping[str, ModuleSnapshot],
    refreshers: Mapping[str, Refresher],
) -> Proof:
    """Compare the processed ``model`` with ``layout`` and the module ``snapshot`` taken at
    load; ``refreshers`` (module name -> :class:`~.extension.Refresher`) declare the derived
    state the caller re-derives, and their ``sources`` become those weights' write targets."""
    live = {name: t for name, t, _ in live_tensors(model)}
    proof = Proof()
    _prove_values(layout, live, refreshers, proof)
    weights = {
        storage_ptr(live[n])
        for n, e in layout.tensors.items()
        if e.fingerprint is not None and n in live and live[n].numel() > 0
    }
    weights.update(storage_ptr(s) for r in refreshers.values() for s in r.sources.values())
    _prove_modules(model, layout, snapshot, refreshers, weights, proof)
    return proof
