"""From a trainer's state to the tensors of a checkpoint under Hugging Face names."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..delta.keyframes import castable_dtype
from .changed import Item, SyncState

ENGINE = "engine"  # CheckpointNames.dtype: each tensor in the dtype the engine holds it in


@dataclass(frozen=True)
class SyncEntry:
    """One tensor of the checkpoint to write: its name, shape and dtype in the file, and the
    trainer tensors it is made of."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    item: Item


@dataclass(frozen=True)
class CheckpointNames:
    """How trainer names become checkpoint names, and the dtype floating tensors are saved in.

    Each ``rename`` regex is applied in order (``{pattern: replacement}``, :func:`re.sub`;
    ``{"^model\\.": ""}`` strips the attribute name Lightning puts in front). Tied tensors
    (embeddings and ``lm_head``) are written once, under their first name, as vLLM and Hugging
    Face expect. Two names mapping to one are refused. ``dtype``: floating tensors are cast to it
    (e.g. ``"bfloat16"``), rounding as the engine's loader does (``Tensor.to``: to nearest, ties to
    even); ``"engine"`` (the default): each to the dtype the engine reported holding it in after
    the last complete push, so a bf16 engine gets bf16 and every byte sent is one it keeps (the
    first sync of a run, before any report, and every tensor an engine does not report, keep
    the trainer's dtype); None keeps the trainer's dtype.
    """

    rename: dict[str, str] = field(default_factory=dict)
    dtype: str | None = ENGINE

    def __post_init__(self) -> None:
        object.__setattr__(self, "rename", dict(self.rename or {}))
        if self.dtype is not None and self.dtype != ENGINE:
            parse_dtype(self.dtype)  # refused up front, not at the first sync
        patterns = [(re.compile(p), r) for p, r in self.rename.items()]
        object.__setattr__(self, "_patterns", patterns)

    def hf_name(self, name: str) -> str:
        for pattern, replacement in self._patterns:  # type: ignore[attr-defined]
            name = pattern.sub(replacement, name)
        return name

    @property
    def fixed_dtype(self) -> torch.dtype | None:
        """The one dtype every floating tensor is cast to (None: the trainer's, or per tensor
        the engine's)."""
        return parse_dtype(self.dtype) if self.dtype not in (None, ENGINE) else None

    def entries(
        self, state: SyncState, engine_dtypes: Mapping[str, str] | None = None
    ) -> tuple[list[SyncEntry], str]:
        """The checkpoint's tensors from shapes and dtypes alone (nothing is gathered), and the
        floating dtype the trainer holds them in. ``engine_dtypes``: checkpoint name -> the
        dtype the engine holds it in (used with ``dtype="engine"``)."""
        cast = self.fixed_dtype
        held = engine_dtypes if self.dtype == ENGINE and engine_dtypes else {}
        out: list[SyncEntry] = []
        origin: dict[str, str] = {}
        seen: set[object] = set()
        source_dtype = ""
        for name, item in state.items():
            if item.key in seen:
                continue
            seen.add(item.key)
            new = self.hf_name(name)
            if new in origin:
                raise ValueError(f"{origin[new]!r} and {name!r} both map to {new!r}")
            origin[new] = name
            first = item.sources[0]
            dtype = first.dtype
            if dtype.is_floating_point:
                source_dtype = source_dtype or str(dtype).removeprefix("torch.")
                dtype = cast or castable_dtype(held.get(new)) or dtype
            out.append(SyncEntry(new, tuple(first.shape), dtype, item))
        return out, source_dtype


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must name a floating torch dtype such as 'bfloat16', not {name!r}")
    return dtype
