"""From a trainer's state dict to the tensors of a checkpoint under Hugging Face names."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["CheckpointNames"]


class CheckpointNames:
    """Renames (``strip_prefix``, then each ``rename`` regex in order), writes tied tensors
    once, optionally casts floating tensors to ``dtype``; refuses two names mapping to one."""

    def __init__(self, strip_prefix: str, rename: Mapping[str, str], dtype: str | None) -> None:
        self.strip_prefix = strip_prefix
        self._rename = [(re.compile(p), r) for p, r in rename.items()]
        self._dtype = parse_dtype(dtype) if dtype is not None else None

    def checkpoint_tensors(self, state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], str]:
        """The tensors to save, and the floating dtype the trainer holds them in."""
        out: dict[str, torch.Tensor] = {}
        origin: dict[str, str] = {}
        seen: set[tuple] = set()
        source_dtype = ""
        for name, t in state.items():
            if not isinstance(t, torch.Tensor):
                continue
            if t.numel():
                # Tied weights (embeddings and lm_head) are one storage: vLLM and Hugging Face
                # both expect it written once, under its first name.
                key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride())
                if key in seen:
                    continue
                seen.add(key)
            new = self.hf_name(name)
            if new in out:
                raise ValueError(f"{origin[new]!r} and {name!r} both map to {new!r}")
            origin[new] = name
            t = t.detach()
            if t.is_floating_point():
                source_dtype = source_dtype or str(t.dtype).removeprefix("torch.")
                if self._dtype is not None:
                    t = t.to(self._dtype)
            out[new] = t.cpu()
        return out, source_dtype

    def hf_name(self, name: str) -> str:
        if self.strip_prefix and name.startswith(self.strip_prefix):
            name = name[len(self.strip_prefix) :]
        for pattern, replacement in self._rename:
            name = pattern.sub(replacement, name)
        return name


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must name a floating torch dtype such as 'bfloat16', not {name!r}")
    return dtype
