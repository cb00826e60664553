"""Adapter syncs: a PEFT LoRA policy sends its adapter, not merged base weights.

A LoRA run trains A and B of each targeted module; the base stays frozen. Merging every adapted
layer sends each targeted weight whole, although the engine can hold the adapter itself in its
LoRA slots (:mod:`weight_bridge.vllm.worker.adapter_writer`). So a sync of a PEFT LoRA policy
writes a PEFT directory (``adapter_model.safetensors`` under PEFT's saved names, through the
project's writer, and PEFT's own ``adapter_config.json``): exactly what ``save_pretrained``
writes and what vLLM's ``LoRARequest`` loads, so a cold start on it is the reference.

What an adapter push cannot serve is decided here once per run, from the model's structure
(:func:`adapter_plan`), and the sync falls back to the merged push with the reason in its
record: the config refusals are :class:`~weight_bridge.checkpoint.adapter.AdapterConfig`'s own
(the rule the engine applies), the rest is what only the live model shows (LoRA on an
embedding, ``lm_head`` or a tied weight, trained base weights, several active adapters, a
rank above vLLM's largest).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import save_checkpoint
from ..checkpoint.adapter import ADAPTER_KIND, ADAPTER_WEIGHTS, KIND_KEY, AdapterConfig
from ..checkpoint.dtensor import is_dtensor
from ..checkpoint.errors import CheckpointError
from .changed import _PEFT_PREFIX, _identities, _lora_layers

# The ranks vLLM's ``max_lora_rank`` takes (``vllm.config.lora.MaxLoRARanks``).
ENGINE_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Slots: the newest version and the one before it (what sampled the last batch).
MAX_LORAS = 2


@dataclass(frozen=True)
class AdapterPlan:
    """How a PEFT policy syncs: its adapter (``why`` None) or merged weights (``why``: the
    reason). ``rank``: the largest rank of any module (what the engine's slots must hold)."""

    rank: int
    modules: int
    why: str | None = None

    @property
    def pushes(self) -> bool:
        return self.why is None

    def fallback(self, why: str) -> AdapterPlan:
        """The same policy, synced merged for ``why`` (the first reason found stays)."""
        return self if self.why is not None else replace(self, why=why)

    def engine_args(self) -> dict[str, Any]:
        """What an engine started for this policy needs: LoRA, slots of the smallest rank vLLM
        allows that holds the adapter, the newest and the previous version resident."""
        rank = next(r for r in ENGINE_RANKS if r >= self.rank)
        return {"enable_lora": True, "max_lora_rank": rank, "max_loras": MAX_LORAS}

    def describe(self) -> dict[str, Any]:
        """The sync record's ``adapter``: what was sent and why."""
        if self.why is None:
            why = f"a PEFT LoRA adapter (rank {self.rank}, {self.modules} modules): A and B only"
            return {"sent": "adapter", "why": why}
        return {"sent": "merged", "why": self.why}


def peft_model(module: Any) -> Any | None:
    """The PEFT model ``module`` is (a ``PeftModel``: it holds ``peft_config`` per adapter)."""
    configs = getattr(module, "peft_config", None)
    return module if isinstance(configs, Mapping) and hasattr(module, "active_adapters") else None


def adapter_plan(module: Any) -> AdapterPlan | None:
    """How a sync of ``module`` goes: None for a module that is no PEFT model (merged, as
    always), else its :class:`AdapterPlan`, with the first reason found to merge instead."""
    model = peft_model(module)
    if model is None:
        return None
    active = list(model.active_adapters)
    layers = _lora_layers(model)
    config = model.peft_config[active[0]] if active else None
    ranks = [getattr(config, "r", 0), *(getattr(config, "rank_pattern", None) or {}).values()]
    plan = AdapterPlan(max(ranks), len(layers))
    if len(active) != 1:
        return plan.fallback(f"{len(active)} active adapters: an adapter push serves one")
    try:
        AdapterConfig.from_dict(config.to_dict(), "<peft config>")  # type: ignore[union-attr]
    except CheckpointError as exc:
        return plan.fallback(exc.problem)
    if plan.rank > ENGINE_RANKS[-1]:
        return plan.fallback(f"rank {plan.rank} exceeds vLLM's largest max_lora_rank 512")
    why = _unservable(model, layers)
    return plan.fallback(why) if why else plan


def _unservable(model: torch.nn.Module, layers: Mapping[str, Any]) -> str | None:
    """Why the live model's adapter has no LoRA slot in vLLM, or None."""
    from peft.tuners.lora import Linear

    _, tied = _identities(model)
    for key, layer in layers.items():
        name = key.removeprefix(_PEFT_PREFIX)
        if not isinstance(layer, Linear):
            return f"LoRA on {name} ({type(layer).__name__}): vLLM's slots take linear layers"
        if name.rsplit(".", 1)[-1] == "lm_head" or id(layer.get_base_layer().weight) in tied:
            return f"LoRA on {name}: the output head (or a weight tied to the embeddings)"
    for name, p in model.named_parameters():
        if is_dtensor(p):
            return "sharded parameters (FSDP2): adapter pushes gather no shards yet"
        if p.requires_grad and ".lora_" not in name:
            name = name.removeprefix(_PEFT_PREFIX)
            return f"{name} is trained too: an adapter push sends only A and B"
    return None


def write_adapter(module: Any, path: Path, metadata: Mapping[str, str], fsync: bool = True) -> int:
    """The active adapter of the PEFT ``module`` as a PEFT directory at ``path`` (built beside
    it, renamed into place: a reader never sees half of one); its data bytes."""
    from peft import get_peft_model_state_dict

    model = peft_model(module)
    assert model is not None, "write_adapter takes a PEFT model"
    name = model.active_adapters[0]
    state = get_peft_model_state_dict(model, adapter_name=name, save_embedding_layers=False)
    building = path.with_name(f".{path.name}.{os.getpid()}.building")
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir(mode=0o700, parents=True)
    try:
        tag = {**metadata, KIND_KEY: ADAPTER_KIND, "format": "pt"}
        saved = save_checkpoint(
            {k: t.detach() for k, t in state.items()}, building / ADAPTER_WEIGHTS, tag, fsync
        )
        config = model.peft_config[name]
        training, config.inference_mode = config.inference_mode, True  # as a saved adapter says
        try:
            config.save_pretrained(str(building))  # PEFT's own JSON
        finally:
            config.inference_mode = training
        shutil.rmtree(path, ignore_errors=True)  # a leftover of a run that died
        os.replace(building, path)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    return saved.bytes
