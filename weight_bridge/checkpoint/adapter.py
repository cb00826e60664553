"""A LoRA adapter as the source of an update: a PEFT directory's config and tensors.

An adapter push writes the adapter's A and B matrices into the engine's LoRA slots instead of
merged base weights. The engine scales B exactly as vLLM scales it when it loads the same PEFT
directory (``alpha / r``, ``alpha / sqrt(r)`` under rsLoRA, per module through
``rank_pattern`` / ``alpha_pattern``), so the scaling rule lives here, read from the one file
both loaders read: ``adapter_config.json``. What neither an adapter push nor vLLM can serve
(DoRA, LoRA biases, full modules to save, layer replication) is refused here, by name, before
anything reaches an engine. No vLLM, no reload core: plain files and dictionaries.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError
from .read import CheckpointReader, read_json

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The metadata a live or saved adapter carries (the trainer side writes it; a PEFT directory
# saved by ``save_pretrained`` is recognised by its config file instead).
KIND_KEY = "weight_bridge.kind"
ADAPTER_KIND = "lora-adapter"
PEFT_CONFIG_KEY = "weight_bridge.peft_config"
# PEFT's saved names: ``base_model.model.<module>.lora_A.weight`` (``lora_B``); embedding
# adapters are ``lora_embedding_A`` / ``lora_embedding_B`` (refused: see ``_refuse_tensor``).
_PEFT_PREFIX = "base_model.model."
_HALVES = {"lora_A": "A", "lora_B": "B"}


def is_adapter(metadata: Mapping[str, str]) -> bool:
    """Whether a checkpoint's metadata marks it as a LoRA adapter (not base weights)."""
    return metadata.get(KIND_KEY) == ADAPTER_KIND


def is_adapter_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a PEFT adapter directory (its config file is the mark: what vLLM's
    own ``LoRARequest`` loads from)."""
    p = Path(path)
    return p.is_dir() and (p / ADAPTER_CONFIG).is_file()


def _match_pattern(pattern: Mapping[str, Any], module: str) -> Any:
    """PEFT's pattern rule (``peft.utils.other.get_pattern_key``, and vLLM's
    ``PEFTHelper._match_pattern``): a key matches a module name it ends, at a ``.`` boundary;
    the first key that matches wins."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return None


@dataclass(frozen=True)
class AdapterConfig:
    """What of ``adapter_config.json`` decides how the tensors land in the slots.

    ``scaling(module)`` is the factor folded into B (vLLM stores B scaled, never A), for a
    module named as PEFT names it (``model.layers.0.self_attn.q_proj``: no ``base_model.model.``
    prefix, before any renaming to the engine's names)."""

    r: int
    alpha: float
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], where: str | os.PathLike) -> AdapterConfig:
        """The config, refused by name where an adapter push (or vLLM's LoRA) cannot serve it."""
        problems = []
        if config.get("peft_type", "LORA") != "LORA":
            problems.append(f"peft_type {config.get('peft_type')!r} is not LORA")
        if config.get("use_dora"):
            problems.append("DoRA (use_dora) has a magnitude vector vLLM's LoRA slots lack")
        if config.get("bias", "none") != "none":
            problems.append(f"LoRA biases (bias={config.get('bias')!r}) have no slot in vLLM")
        if config.get("modules_to_save"):
            problems.append(
                f"modules_to_save {config.get('modules_to_save')!r}: full modules are base "
                "weights, not adapter slots"
            )
        if config.get("layer_replication"):
            problems.append("layer_replication changes the base model's layers")
        r, alpha = config.get("r"), config.get("lora_alpha")
        if not isinstance(r, int) or r <= 0:
            problems.append(f"rank r={r!r} is not a positive integer")
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            problems.append(f"lora_alpha={alpha!r} is not a number")
        ranks = dict(config.get("rank_pattern") or {})
        for key, rank in ranks.items():
            if not isinstance(rank, int) or rank <= 0:
                problems.append(f"rank_pattern[{key!r}]={rank!r} is not a positive integer")
        if problems:
            raise CheckpointError(
                where, "adapter not servable as LoRA slots: " + "; ".join(problems)
            )
        return cls(
            r=int(r),  # type: ignore[arg-type]
            alpha=float(alpha),  # type: ignore[arg-type]
            use_rslora=bool(config.get("use_rslora", False)),
            rank_pattern=ranks,
            alpha_pattern=dict(config.get("alpha_pattern") or {}),
        )

    def rank(self, module: str) -> int:
        """The rank PEFT trained ``module`` with (``rank_pattern`` first, else ``r``)."""
        rank = _match_pattern(self.rank_pattern, module)
        return self.r if rank is None else int(rank)

    def scaling(self, module: str) -> float:
        """The factor B is multiplied by, computed as vLLM computes it (a Python float)."""
        alpha = _match_pattern(self.alpha_pattern, module)
        alpha = self.alpha if alpha is None else alpha
        rank = self.rank(module)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def read_adapter_config(path: str | os.PathLike) -> AdapterConfig:
    """``adapter_config.json`` of a PEFT directory, size-capped and validated."""
    file = Path(path) / ADAPTER_CONFIG
    doc = read_json(file, "adapter config")
    if not isinstance(doc, dict):
        raise CheckpointError(file, "corrupt adapter config: not a JSON object")
    return AdapterConfig.from_dict(doc, file)


def adapter_part(name: str) -> tuple[str, str] | None:
    """``(module, "A" | "B")`` of a PEFT tensor name, the module as PEFT names it (what
    ``rank_pattern`` matches); ``None`` for a name that is no LoRA matrix. Raises for the
    LoRA matrices an adapter push refuses (embedding adapters)."""
    parts = name.removeprefix(_PEFT_PREFIX).split(".")
    if len(parts) >= 3 and parts[-1] == "weight" and parts[-2] in _HALVES:
        return ".".join(parts[:-2]), _HALVES[parts[-2]]
    if any(p.startswith("lora_embedding_") for p in parts):
        raise CheckpointError("<adapter>", "LoRA on an embedding has no adapter push yet", name)
    return None


def read_adapter(path: str | os.PathLike) -> tuple[AdapterConfig, dict[str, torch.Tensor]]:
    """A PEFT directory's config and its LoRA tensors (copied out of the mapping, so the
    reader can close), every name a LoRA matrix (anything else is refused by name)."""
    config = read_adapter_config(path)
    tensors: dict[str, torch.Tensor] = {}
    with CheckpointReader(Path(path) / ADAPTER_WEIGHTS) as reader:
        for name, view in reader.tensors():
            try:
                part = adapter_part(name)
            except CheckpointError as exc:
                raise CheckpointError(path, exc.problem, name) from None
            if part is None:
                raise CheckpointError(path, "not a LoRA matrix (lora_A / lora_B)", name)
            tensors[name] = view.clone()
    return config, tensors
