"""Seeded PEFT LoRA adapters on the tiny models: the source of an adapter push, and what a
reference cold start loads through vLLM's own ``LoRARequest`` (the same directory).

Saved with PEFT's own ``save_pretrained``, so names, config and file are exactly what a trainer
using PEFT writes. A and B are drawn at random (PEFT initialises B to zero, which would make
every adapter the base model and every comparison vacuous).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def build_peft_adapter(
    base: str | Path,
    path: str | Path,
    seed: int = 1,
    r: int = 8,
    alpha: int = 24,
    targets: tuple[str, ...] = ATTENTION + MLP,
    std: float = 0.2,
    **config: Any,
) -> Path:
    """A PEFT adapter directory for the model at ``base`` (rank ``r``, ``lora_alpha=alpha``,
    ``targets``, any other ``LoraConfig`` field in ``config``), its A and B seeded normal with
    ``std``. The default alpha/r = 3 is not a power of two, so B's scaling rounds in bf16."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, **config
    )
    peft_model = get_peft_model(model, lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * std)
    peft_model.save_pretrained(str(path))
    return Path(path)
