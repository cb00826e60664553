"""Where an adapter's tensors land in an engine's LoRA slots, and with which bits.

vLLM keeps one buffer per LoRA layer and per packed slice (``q``, ``k``, ``v`` of a fused
``qkv_proj``; ``gate``, ``up`` of ``gate_up_proj``), one row per slot. An adapter push must
leave in a slot exactly the bits a cold start of vLLM on the same PEFT directory leaves there,
or the tokens it samples are not the adapter's. Two things decide those bits, both here, once:

* the order of the cast and the scaling (:func:`slot_tensors`): vLLM casts A and B to the LoRA
  dtype, then multiplies B by the scaling in that dtype (``LoRALayerWeights.optimize``); in bf16
  scaling first rounds differently;
* the module and slice of each PEFT module (:func:`slot_map`), through the engine's own name
  parser and packed-module table (passed in: this layer knows no vLLM).

Plain PyTorch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from .errors import DirectReloadError


def slot_tensors(
    a: torch.Tensor, b: torch.Tensor, scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B as vLLM stores them for a slot: cast to ``dtype`` on the CPU, then B scaled in
    place in that dtype (never the other order: a bf16 B scaled before the cast differs in its
    last bit from what vLLM loads). New tensors: the caller's are never modified."""
    a = a.detach().to(device="cpu", dtype=dtype, copy=True)
    b = b.detach().to(device="cpu", dtype=dtype, copy=True)
    if scaling != 1:
        b *= scaling
    return a, b


@dataclass(frozen=True)
class SlotPart:
    """One PEFT module's place in the engine: the engine's LoRA layer, the slice of it (0 for
    an unpacked layer), and the PEFT names of its two matrices."""

    layer: str
    slice: int
    peft_module: str
    a_name: str
    b_name: str


def slot_map(
    names: Iterable[str],
    parse: Callable[[str], tuple[str, bool]],
    layers: Iterable[str],
    packed: Mapping[str, list[str]],
    peft_module: Callable[[str], str],
) -> dict[str, list[SlotPart | None]]:
    """Every LoRA layer the adapter targets -> its slices (``None``: a slice the adapter does
    not target, which the slot holds as zeros, as vLLM leaves it).

    ``parse(name) -> (module, is_a)`` is the engine's parser (renaming included),
    ``layers`` the engine's LoRA layers, ``packed`` its ``{layer: [module per slice]}``,
    ``peft_module(name)`` the module as PEFT names it (what the config's patterns match).
    Refused (:class:`DirectReloadError`, nothing written), each by name: a module the engine
    has no LoRA layer for, a module with only one of A and B, a module named twice."""
    layers = set(layers)
    slice_of = {m: (layer, i) for layer, parts in packed.items() for i, m in enumerate(parts)}
    halves: dict[str, dict[bool, str]] = {}
    problems: dict[str, str] = {}
    for name in names:
        module, is_a = parse(name)
        seen = halves.setdefault(module, {})
        if is_a in seen:
            problems[name] = f"{module} is also named by {seen[is_a]}"
        seen[is_a] = name
    out: dict[str, list[SlotPart | None]] = {}
    for module, seen in sorted(halves.items()):
        if len(seen) != 2:
            have = next(iter(seen.values()))
            problems[have] = f"{module} has only lora_{'A' if True in seen else 'B'}"
            continue
        if module in layers and module not in packed:
            layer, index, width = module, 0, 1
        elif module in slice_of:
            (layer, index), width = slice_of[module], len(packed[slice_of[module][0]])
        else:
            problems[seen[True]] = f"no LoRA layer for {module} in the engine"
            continue
        parts = out.setdefault(layer, [None] * width)
        parts[index] = SlotPart(layer, index, peft_module(seen[True]), seen[True], seen[False])
    if problems:
        raise DirectReloadError("adapter does not fit the engine's LoRA layers", problems)
    return out
