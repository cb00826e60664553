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

A :class:`Refresher` (registered by the engine integration for state it knows how to re-derive:
the CPU backend's packed linears and prepacked MoE experts) turns such a module into one that is
written directly and then refreshed. What is neither proven nor refreshable must be re-processed
by the engine's own path or refused by name.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..layout import fingerprint, live_tensors, storage_ptr
from ..state import bridge_state
from .errors import DirectReloadError, NotDirectlyReloadable
from .resolve import resolve_target, signature

__all__ = [
    "ModuleSnapshot",
    "Proof",
    "Refresher",
    "ensure_proof",
    "module_of",
    "prove_checkpoint_layout",
    "snapshot_modules",
]

# (kind, identity, storage pointer, version counter, numel) of one attribute of a module
Entry = tuple[str, int, int, int, int]
ModuleSnapshot = dict[str, Entry]

_PLAIN = (bool, int, float, str, bytes, type(None), enum.Enum, torch.dtype, torch.device)
_SKIP = {"_parameters", "_buffers", "_modules", "training"}


def module_of(name: str) -> tuple[str, str]:
    """``"a.b.weight"`` -> ``("a.b", "weight")``."""
    module, _, attr = name.rpartition(".")
    return module, attr


def _entry(value: object) -> Entry | None:
    if isinstance(value, torch.Tensor):
        ptr = storage_ptr(value) if value.device.type != "meta" else 0
        return ("tensor", id(value), ptr, int(value._version), value.numel())
    if isinstance(value, _PLAIN) or value is None:
        return None
    if inspect.isfunction(value) and not value.__closure__:
        return None  # a plain function holds no state of its own
    if inspect.isbuiltin(value) or inspect.isclass(value):
        return None
    return ("object", id(value), 0, 0, 0)


def snapshot_module(module: torch.nn.Module) -> ModuleSnapshot:
    """Identity, storage and version of every tensor and stateful object a module holds."""
    snap: ModuleSnapshot = {}
    for name, p in module._parameters.items():
        if p is not None:
            snap[name] = _entry(p)  # type: ignore[assignment]
    for name, b in module._buffers.items():
        if b is not None:
            snap[name] = _entry(b)  # type: ignore[assignment]
    for name, value in vars(module).items():
        if name in _SKIP or name.startswith("_forward") or name.startswith("_backward"):
            continue
        e = _entry(value)
        if e is not None:
            snap[name] = e
    return snap


def snapshot_modules(model: torch.nn.Module) -> dict[str, ModuleSnapshot]:
    """:func:`snapshot_module` of every module, by qualified name."""
    return {name: snapshot_module(m) for name, m in model.named_modules()}


@dataclass
class Refresher:
    """Derived state of one module that the bridge knows how to re-derive after a write.

    ``sources`` maps a parameter name of the module to the tensor, in checkpoint layout, that a
    write must target instead of the live parameter (kept by the refresher because processing
    transformed the live one); ``explains`` names the module attributes whose creation or
    change the refresher accounts for. :meth:`refresh` re-derives them in place.
    """

    kind: str
    explains: frozenset[str] = frozenset()
    sources: dict[str, torch.Tensor] = field(default_factory=dict)

    def refresh(self, module: torch.nn.Module) -> None:
        raise NotImplementedError


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


@torch.no_grad()
def prove_checkpoint_layout(
    model: torch.nn.Module, refreshers: Mapping[str, Refresher] | None = None
) -> Proof:
    """Compare the processed ``model`` with what was recorded at load; keep and return the proof.

    Call it after post-load processing (a direct reload calls it on first use otherwise).
    ``refreshers`` (module name -> :class:`Refresher`) declare derived state the caller can
    re-derive; their ``sources`` become those weights' write targets.
    """
    state = bridge_state(model)
    layout = state.layout
    if layout is None or state.snapshot is None:
        raise DirectReloadError(
            "no checkpoint layout recorded on this model: call record_checkpoint_layout(model) "
            "right after its weights are first loaded"
        )
    if refreshers:
        state.refreshers.update(refreshers)
    live = {name: t for name, t, _ in live_tensors(model)}
    proof = Proof()
    for name, entry in layout.tensors.items():
        if entry.fingerprint is None or name not in live:
            continue
        try:
            view = resolve_target(entry, write_tensor(model, name, live[name])).view
        except NotDirectlyReloadable:
            continue  # the plan refuses it with the resolution's own reason
        got = fingerprint(view)
        if entry.fingerprint.matches(got):
            proof.targets[name] = signature(view)
        else:
            proof.transformed[name] = (
                "values changed by post-load processing (transformed, not only moved: "
                "a write in checkpoint layout would not be what the model computes with)"
            )
    weights = {
        storage_ptr(live[n])
        for n, e in layout.tensors.items()
        if e.fingerprint is not None and n in live and live[n].numel() > 0
    }
    weights.update(storage_ptr(s) for r in state.refreshers.values() for s in r.sources.values())
    recorded_by_module: dict[str, set[str]] = {}
    for name, entry in layout.tensors.items():
        if entry.fingerprint is not None:  # a weight a checkpoint writes
            module, attr = module_of(name)
            recorded_by_module.setdefault(module, set()).add(attr)
    for module_name, module in model.named_modules():
        before = state.snapshot.get(module_name, {})
        after = snapshot_module(module)
        refresher = state.refreshers.get(module_name)
        recorded = recorded_by_module.get(module_name, set())
        if refresher is not None:
            recorded = recorded | refresher.explains
        items = _derived_items(before, after, recorded, weights)
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
    state.proof = proof
    return proof


def ensure_proof(model: torch.nn.Module) -> Proof:
    """The model's proof, computed now if it was not yet (first reload after processing)."""
    state = bridge_state(model)
    return state.proof if state.proof is not None else prove_checkpoint_layout(model)


def write_tensor(model: torch.nn.Module, name: str, live: torch.Tensor) -> torch.Tensor:
    """The tensor a write of ``name`` goes into: a refresher's source, else the live one."""
    module, attr = module_of(name)
    refresher = bridge_state(model).refreshers.get(module)
    if refresher is not None and attr in refresher.sources:
        return refresher.sources[attr]
    return live
