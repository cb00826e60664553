"""Every read and write of vLLM's LoRA internals (checklist sites 22 and 24), one place.

An adapter push fills a LoRA slot with vLLM's own code (the layers' ``set_lora`` /
``reset_lora`` through ``activate_adapter``, which also does the tensor-parallel slicing) and
registers the CPU copy the slot was filled from under a fresh id: vLLM has no public call that
loads an adapter from tensors (``LoRARequest`` takes a path). So the bits in a slot are a cold
load's by construction, and what the manager re-fills an evicted slot from is the same copy.

Also here: the patch that keeps the adapters across ``finish_weight_update`` unless the update
wrote base weights (vLLM's worker calls ``reset_lora_state``, which drops every adapter, after
every weight update: verified on 0.32 and 0.34, even after an update that wrote nothing), and
the one spelling of a version's LoRA name (:func:`adapter_name`), from which the front end labels
each token an adapter sampled with that adapter's version (:func:`labelling_adapter_tokens`).

Like the rest of this package, nothing of the project is imported: refusals are returned as
strings for the caller to raise.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

# Ids the bridge gives its versions: clear of vLLM's dummy ids (1..max_loras) and of the small
# ids users pick; int32 (vLLM 0.34 keeps the batch's ids in an int32 tensor).
FIRST_ID = 1 << 30

_keep_once: weakref.WeakSet[Any] = weakref.WeakSet()  # managers whose next reset is skipped
_last_id: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def next_id(manager: Any) -> int:
    """A LoRA id no adapter of this engine ever had: vLLM keys a request's adapter by id and
    its prefix cache by name and path, so a reused id could meet another version's bits. The
    same on every rank (each rank prepares the same pushes in the same order)."""
    _last_id[manager] = _last_id.get(manager, FIRST_ID - 1) + 1
    return _last_id[manager]


def manager_of(model: torch.nn.Module) -> Any | None:
    """The LoRA model manager of a worker's model (vLLM sets ``model.lora_manager`` when it
    wraps the model for LoRA), or None: the engine was not started with ``enable_lora``."""
    return getattr(model, "lora_manager", None)


def lora_layers(manager: Any) -> dict[str, Any]:
    """The engine's LoRA layers by full name (``model.layers.0.self_attn.qkv_proj``)."""
    return dict(manager.modules)


def packed_layers(manager: Any) -> dict[str, list[str]]:
    """``{packed layer: [the module of each slice]}``, full names, as the manager packs them."""
    return {k: list(v) for k, v in manager.packed_modules.items()}


def name_parser(manager: Any) -> Callable[[str], tuple[str, bool]]:
    """vLLM's own parser of a PEFT tensor name -> ``(module, is_a)``, with the model's rename
    mapper, as ``WorkerLoRAManager._load_adapter`` calls it."""
    from vllm.lora.utils import parse_fine_tuned_lora_name

    mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
    mapper = mapper.get_rename_mapper() if mapper is not None else None
    return lambda name: parse_fine_tuned_lora_name(name, mapper)


def max_rank(manager: Any) -> int:
    return int(manager.lora_config.max_lora_rank)


def slot_dtype(manager: Any) -> torch.dtype:
    """The dtype the slots hold (``lora_dtype``, resolved at start)."""
    _, view = next(slot_views(manager, 0))
    return view.dtype


def slot_views(manager: Any, slot: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Every buffer row of ``slot``, named ``layer.A[i]`` / ``layer.B[i]`` (``i``: the packed
    slice; a layer whose stack is one tensor, the logits processor's, has slice 0)."""
    for name, module in manager.modules.items():
        for half, stacked in (("A", module.lora_a_stacked), ("B", module.lora_b_stacked)):
            parts = stacked if isinstance(stacked, (tuple, list)) else (stacked,)
            for i, part in enumerate(parts):
                yield f"{name}.{half}[{i}]", part[slot]


def layer_shapes(manager: Any, name: str) -> list[tuple[int, int, int, int]]:
    """``[(rank rows, in, out, rank cols)]`` per slice of a LoRA layer's slot buffers."""
    module = manager.modules[name]
    a, b = module.lora_a_stacked, module.lora_b_stacked
    a = a if isinstance(a, (tuple, list)) else (a,)
    b = b if isinstance(b, (tuple, list)) else (b,)
    return [(x.shape[-2], x.shape[-1], y.shape[-2], y.shape[-1]) for x, y in zip(a, b, strict=True)]


def cpu_copy(
    lora_id: int, rank: int, slices: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
) -> Any:
    """The CPU copy vLLM registers for an adapter: ``{module: (A, B)}`` already cast and
    scaled (scaling 1, so vLLM's packing and ``optimize`` leave the bits alone), keyed by the
    module names of the adapter (``...q_proj``; vLLM packs them into its layers on add)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.lora_weights import LoRALayerWeights

    loras = {
        module: LoRALayerWeights(module, int(a.shape[0]), 1, a, b, scaling=1.0)
        for module, (a, b) in slices.items()
    }
    return LoRAModel(lora_id, rank, loras)


def registered(manager: Any) -> dict[int, Any]:
    """The manager's CPU copies by id."""
    return dict(manager.list_adapters())


def slot_of(manager: Any, lora_id: int) -> int | None:
    """The slot an id is active in, or None."""
    index = manager.lora_index_to_id
    return index.index(lora_id) if lora_id in index else None


def free_slot(manager: Any) -> int | None:
    return next((i for i, x in enumerate(manager.lora_index_to_id) if x is None), None)


def slot_ids(manager: Any) -> list[int | None]:
    return list(manager.lora_index_to_id)


def activate(manager: Any, copy: Any) -> int:
    """Register ``copy`` and fill a free slot with it through vLLM's own ``activate_adapter``
    (every LoRA layer: ``set_lora`` with the copy's tensors, ``reset_lora`` where it has
    none), pinned so no other adapter evicts it; the slot it landed in."""
    manager.add_adapter(copy)
    manager.activate_adapter(copy.id)
    manager.pin_adapter(copy.id)
    slot = slot_of(manager, copy.id)
    assert slot is not None
    return slot


def retire(manager: Any, lora_id: int) -> Any:
    """Remove an adapter (its slot freed, its CPU copy dropped, unpinned); its CPU copy."""
    copy = manager.list_adapters().get(lora_id)
    for cache in (manager._registered_adapters, manager._active_adapters):
        cache.pinned_items.discard(lora_id)
    manager.remove_adapter(lora_id)
    return copy


def keep_adapters_once(manager: Any) -> None:
    """Skip the next ``reset_lora_state`` of this manager's runner: set when an update is
    prepared, cleared by :func:`base_written` when it writes base weights; so an update that
    wrote an adapter, or nothing (a refusal), keeps every resident adapter, which is exact."""
    _keep_once.add(manager)


def base_written(manager: Any) -> None:
    """Base weights are being written: vLLM's reset at the update's end drops every adapter
    (a slot computed on the old base is no version a cold start would hold)."""
    _keep_once.discard(manager)


def keeping_adapters(original: Callable[[Any], None]) -> Callable[[Any], None]:
    """``reset_lora_state`` that skips once after an update that wrote no base weight (see
    :func:`keep_adapters_once`), and otherwise drops every adapter, as vLLM does."""

    def reset_lora_state(self: Any) -> None:
        manager = getattr(getattr(self, "lora_manager", None), "_adapter_manager", None)
        if manager is not None and manager in _keep_once:
            _keep_once.discard(manager)
            return
        original(self)

    return reset_lora_state


_NAME = "weight-bridge@"  # a version's LoRA name: _NAME + version + "~" + its id


def adapter_name(version: str, lora_id: int) -> str:
    """The LoRA name of ``version``, held under ``lora_id``: unique for the engine's life (vLLM
    keys the prefix cache by name and path, and 0.32 tells requests' adapters apart by name),
    and it says the version, so every token sampled with it is labelled so."""
    return f"{_NAME}{version}~{lora_id}"


def adapter_version(name: str | None) -> str | None:
    """The version a LoRA name of :func:`adapter_name` says, else None (a user's adapter)."""
    if not name or not name.startswith(_NAME) or "~" not in name:
        return None
    version, _, lora_id = name[len(_NAME) :].rpartition("~")
    return version if lora_id.isdigit() else None


def labelling_adapter_tokens(original: Callable[[Any, str], None]) -> Callable[[Any, str], None]:
    """The front end's ``RequestState.track_weight_version``: a request sampled with a version
    the bridge pushed as an adapter is labelled with that version (its slot's bits never change
    under its id), whatever the engine's label, which names the base weights."""

    def track_weight_version(self: Any, weight_version: str) -> None:
        original(self, adapter_version(getattr(self, "lora_name", None)) or weight_version)

    return track_weight_version


def lora_request(entry: Mapping[str, Any] | None) -> Any:
    """vLLM's ``LoRARequest`` for a resident version (its name, id and the PEFT directory it
    came from, which vLLM reloads only if its CPU copy is gone), or None."""
    if entry is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(entry["name"], int(entry["id"]), str(entry["path"]))
