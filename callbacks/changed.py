"""What a sync sends: the policy's state under the base model's names, LoRA adapters merged,
and (for a partial checkpoint) only the tensors training can change.

RL fine-tuning often trains a fraction of the model (frozen embeddings or lower layers, LoRA
adapters). The engine serves the base architecture: it knows neither PEFT's wrapper names
(``base_model.model.``, ``.base_layer``) nor adapter matrices. So the trainer side merges each
adapted weight (base + the adapter's delta, computed by PEFT itself) and pushes it under the
base name; a partial sync then carries only the merged weights and the parameters that require
grad (buffers always: they are small and may change without gradients). The frozen base
weights never leave the trainer after the first, complete push.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["SyncState", "sync_state"]

_PEFT_PREFIX = "base_model.model."
_ADAPTER_PARTS = ("lora_", "base_layer.")


class SyncState(dict):
    """Name -> tensor to save; ``partial``: whether tensors that cannot change were left out."""

    partial: bool = False


def _lora_layers(root: torch.nn.Module) -> dict[str, Any]:
    """PEFT LoRA layers under ``root`` (by duck type: PEFT is an optional dependency)."""
    return {
        name: m
        for name, m in root.named_modules()
        if type(m).__module__.startswith("peft.") and hasattr(m, "get_delta_weight")
    }


def _merged_weight(name: str, layer: Any, tied: set[int]) -> tuple[torch.Tensor, bool]:
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
    weight = base.detach()
    if not getattr(layer, "merged", False):
        for a in adapters:
            weight = weight + layer.get_delta_weight(a).detach().to(weight.dtype)
    trainable = any(
        p.requires_grad
        for a in adapters
        for key in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")
        for p in _adapter_params(getattr(layer, key, {}), a)
    )
    return weight, trainable or base.requires_grad


def _adapter_params(container: Any, adapter: str) -> list[torch.nn.Parameter]:
    if adapter not in container:
        return []
    item = container[adapter]
    return list(item.parameters()) if isinstance(item, torch.nn.Module) else [item]


def sync_state(
    root: torch.nn.Module | None, state: Mapping[str, Any], changing_only: bool
) -> SyncState:
    """``state`` (``root.state_dict()``-like) as the engine's model sees it.

    LoRA layers of ``root`` become their merged weight under the base name; PEFT's wrapper
    prefix is dropped. ``changing_only`` keeps just the tensors training can change: merged
    weights with a trainable adapter, parameters that require grad, and buffers. Without a
    ``root`` (a custom ``source``) the state is passed through whole.
    """
    out = SyncState()
    if root is None:
        out.update(state)
        return out
    params = dict(root.named_parameters(remove_duplicate=False))
    counts: dict[int, int] = {}
    for p in params.values():
        counts[id(p)] = counts.get(id(p), 0) + 1
    tied = {i for i, n in counts.items() if n > 1}
    lora = _lora_layers(root)
    peft = hasattr(root, "peft_config") and all(k.startswith(_PEFT_PREFIX) for k in state)
    for key, t in state.items():
        if not isinstance(t, torch.Tensor):
            continue
        if ".modules_to_save." in key or ".original_module." in key:
            raise ValueError(f"{key}: PEFT modules_to_save are not supported by the weight sync")
        owner, _, rest = key.rpartition(".")
        while owner and owner not in lora:
            owner, _, part = owner.rpartition(".")
            rest = f"{part}.{rest}"
        name, changing = key, True
        if owner:
            if not rest.startswith(_ADAPTER_PARTS):
                raise ValueError(f"{key}: unexpected tensor in a LoRA layer")
            if rest.startswith("lora_"):
                continue  # adapter matrices: folded into the merged weight
            name = f"{owner}.{rest.removeprefix('base_layer.')}"
            if rest == "base_layer.weight":
                t, changing = _merged_weight(owner, lora[owner], tied)
            else:
                changing = params[key].requires_grad if key in params else True
        elif key in params:
            changing = params[key].requires_grad
        if changing_only and not changing:
            out.partial = True
            continue
        out[name.removeprefix(_PEFT_PREFIX) if peft else name] = t
    return out
