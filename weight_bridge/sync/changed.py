"""What a sync sends: the policy's state under the base model's names, LoRA adapters merged,
and (for a partial checkpoint) only the tensors training can change.

RL fine-tuning often trains a fraction of the model (frozen embeddings or lower layers, LoRA
adapters). The engine serves the base architecture: it knows neither PEFT's wrapper names
(``base_model.model.``, ``.base_layer``) nor adapter matrices. So the trainer side merges each
adapted weight (base + the adapter's delta, computed by PEFT itself) and pushes it under the
base name; a partial sync then carries only the merged weights and the parameters that require
grad (buffers always: they are small and may change without gradients). The frozen base
weights never leave the trainer after the first, complete push.

Nothing here reads a tensor's values: :func:`sync_state` decides from names, module structure
and ``requires_grad`` alone, and each :class:`Item` says which trainer tensors make one
checkpoint tensor and how to combine them. That is what lets a sharded trainer gather them one
at a time (:mod:`.gather`): a LoRA delta is computed by PEFT on the *gathered* base and
adapter matrices, exactly as on a replicated model.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..layout import tie_key

_PEFT_PREFIX = "base_model.model."
_ADAPTER_PARTS = ("lora_", "base_layer.")


@dataclass(frozen=True)
class Item:
    """One checkpoint tensor: the trainer tensors it is made of (possibly sharded), and how.

    ``merge`` (None: the tensor is ``sources[0]``) combines the full, gathered ``sources``;
    the result has the shape and dtype of ``sources[0]``. ``key`` is equal for tensors that are
    one storage in the trainer (tied weights), which are written once.
    """

    sources: tuple[torch.Tensor, ...]
    merge: Callable[[Sequence[torch.Tensor]], torch.Tensor] | None
    key: object


class SyncState(dict[str, Item]):
    """Name -> :class:`Item`; ``partial``: whether tensors that cannot change were left out."""

    partial: bool = False


def _lora_layers(root: torch.nn.Module) -> dict[str, Any]:
    """PEFT LoRA layers under ``root`` (by duck type: PEFT is an optional dependency)."""
    return {
        name: m
        for name, m in root.named_modules()
        if type(m).__module__.startswith("peft.") and hasattr(m, "get_delta_weight")
    }


def _adapter_slots(layer: Any, adapter: str) -> list[tuple[torch.nn.Module, str]]:
    """Where an adapter's A and B matrices live: (module, parameter name) pairs."""
    if adapter in getattr(layer, "lora_A", {}):
        return [(layer.lora_A[adapter], "weight"), (layer.lora_B[adapter], "weight")]
    return [(layer.lora_embedding_A, adapter), (layer.lora_embedding_B, adapter)]


@contextlib.contextmanager
def _swapped(slots: list[tuple[torch.nn.Module, str]], tensors: Sequence[torch.Tensor]):
    """The slots hold ``tensors`` (gathered, plain) for the block; then their own again."""
    saved = [m._parameters[name] for m, name in slots]
    try:
        for (m, name), t in zip(slots, tensors, strict=True):
            m._parameters[name] = t  # type: ignore[assignment]
        yield
    finally:
        for (m, name), p in zip(slots, saved, strict=True):
            m._parameters[name] = p


def _merged(name: str, layer: Any, tied: set[int]) -> tuple[Item, bool]:
    """The weight generation must use for one LoRA layer, and whether it can change."""
    base = layer.get_base_layer().weight
    adapters = [
        a
        for a in layer.active_adapters
        if a in getattr(layer, "lora_A", {}) or a in getattr(layer, "lora_embedding_A", {})
    ]
    for a in adapters:
        if getattr(layer, "use_dora", {}).get(a):
            raise ValueError(f"{name}: DoRA adapters are not merged by the weight sync")
    if adapters and id(base) in tied:
        raise ValueError(
            f"{name}: a LoRA adapter on a tied weight (embeddings shared with lm_head) cannot be "
            "served: the engine holds one tensor for both uses, the trainer adapts only one"
        )
    if getattr(layer, "merged", False):
        adapters = []  # the base weight already holds the deltas
    slots = [slot for a in adapters for slot in _adapter_slots(layer, a)]
    trainable = any(getattr(m, n).requires_grad for m, n in slots) or base.requires_grad

    @torch.no_grad()
    def merge(gathered: Sequence[torch.Tensor]) -> torch.Tensor:
        weight, *matrices = gathered
        with _swapped(slots, matrices):  # PEFT computes the delta on the gathered matrices
            for a in adapters:
                weight = weight + layer.get_delta_weight(a).detach().to(weight.dtype)
        return weight

    sources = (base.detach(), *(getattr(m, n).detach() for m, n in slots))
    if not adapters:  # the base weight itself, tied or not
        return Item(sources, None, ("object", id(base))), trainable
    return Item(sources, merge, object()), trainable


def _owner(key: str, lora: Mapping[str, Any]) -> tuple[str, str]:
    """The LoRA layer holding ``key`` ("" if none) and the rest of the key below it."""
    owner, _, rest = key.rpartition(".")
    while owner and owner not in lora:
        owner, _, part = owner.rpartition(".")
        rest = f"{part}.{rest}"
    return owner, rest


def _identities(root: torch.nn.Module) -> tuple[dict[str, Any], set[int]]:
    """State key -> the parameter or buffer object, and the ids of tied parameters."""
    params = dict(root.named_parameters(remove_duplicate=False))
    counts = Counter(id(p) for p in params.values())
    objects: dict[str, Any] = dict(root.named_buffers(remove_duplicate=False))
    objects.update(params)
    return objects, {i for i, n in counts.items() if n > 1}


def sync_state(
    root: torch.nn.Module | None, state: Mapping[str, Any], changing_only: bool
) -> SyncState:
    """``state`` (``root.state_dict()``-like) as the engine's model sees it, as :class:`Item`\\ s.

    LoRA layers of ``root`` become their merged weight under the base name; PEFT's wrapper
    prefix is dropped. ``changing_only`` keeps just the tensors training can change: merged
    weights with a trainable adapter, parameters that require grad, and buffers. Without a
    ``root`` (a custom ``source``) the state is passed through whole. Non-tensors are skipped.
    """
    out = SyncState()
    objects, tied = _identities(root) if root is not None else ({}, set())
    lora = _lora_layers(root) if root is not None else {}
    peft = hasattr(root, "peft_config") and all(k.startswith(_PEFT_PREFIX) for k in state)
    for key, t in state.items():
        if not isinstance(t, torch.Tensor):
            continue
        if ".modules_to_save." in key or ".original_module." in key:
            raise ValueError(f"{key}: PEFT modules_to_save are not supported by the weight sync")
        owner, rest = _owner(key, lora)
        name, obj = key, objects.get(key)
        item = Item((t,), None, ("object", id(obj)) if obj is not None else tie_key(t))
        changing = obj.requires_grad if isinstance(obj, torch.nn.Parameter) else True
        if owner:
            if not rest.startswith(_ADAPTER_PARTS):
                raise ValueError(f"{key}: unexpected tensor in a LoRA layer")
            if rest.startswith("lora_"):
                continue  # adapter matrices: folded into the merged weight
            name = f"{owner}.{rest.removeprefix('base_layer.')}"
            if rest == "base_layer.weight":
                item, changing = _merged(owner, lora[owner], tied)
        if changing_only and not changing:
            out.partial = True
            continue
        out[name.removeprefix(_PEFT_PREFIX) if peft else name] = item
    return out


def materialize(state: SyncState) -> Iterator[tuple[str, torch.Tensor]]:
    """Each item's tensor, for a state whose sources are plain (not sharded) tensors."""
    for name, item in state.items():
        yield name, item.merge(item.sources) if item.merge else item.sources[0]
