"""The resolution rule: which view of a weight's *current* storage a checkpoint tensor maps to.

1. Same storage as at load (pointer and size unchanged): the recorded offset, shape and stride.
   This covers in-place view transforms (transpose, narrow) done after load.
2. Moved to another storage with the same shape and dtype: the weight's *current* offset and
   stride. The recorded offset belongs to the old storage; reusing it would overwrite a
   neighbour in the new one (vLLM PR 65281).
3. Anything else (storage emptied or packed into a kernel format, dtype changed, moved *and*
   reshaped, device changed, targets overlapping another weight) cannot be resolved.

Resolution says *where* a write lands; whether what lies there is still the checkpoint's values
(a move, not a transform) is :mod:`.proof`'s job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..layout import TensorLayout, byte_span, storage_ptr
from .errors import NotDirectlyReloadable


@dataclass(frozen=True)
class Relocation:
    """A weight resolved at its current offset because its storage moved since load."""

    name: str
    from_storage: int
    from_offset: int
    to_storage: int
    to_offset: int


@dataclass
class ResolvedTarget:
    """The view a checkpoint tensor must be written into."""

    name: str
    view: torch.Tensor
    relocation: Relocation | None = None


def signature(view: torch.Tensor) -> tuple:
    """Where a view writes: storage, offset, shape, stride, dtype."""
    return (
        storage_ptr(view),
        int(view.storage_offset()),
        tuple(view.shape),
        tuple(view.stride()),
        view.dtype,
    )


def resolve_target(entry: TensorLayout, live: torch.Tensor) -> ResolvedTarget:
    """The view of ``live``'s current storage that the checkpoint tensor ``entry`` maps to."""
    if live.device != entry.device:
        raise NotDirectlyReloadable(f"moved from {entry.device} to {live.device}")
    if live.dtype != entry.dtype:
        raise NotDirectlyReloadable(
            f"dtype changed from {entry.dtype} to {live.dtype} since load "
            "(packed into another format)"
        )
    numel = math.prod(entry.shape)
    storage = live.untyped_storage()
    if numel > 0 and (storage.nbytes() == 0 or live.numel() == 0):
        raise NotDirectlyReloadable(
            "storage emptied since load (weight packed into an opaque kernel format or freed)"
        )
    if storage.data_ptr() == entry.storage_ptr and storage.nbytes() == entry.storage_nbytes:
        view = torch.as_strided(live.detach(), entry.shape, entry.stride, entry.storage_offset)
        return ResolvedTarget(entry.name, view)
    if tuple(live.shape) != entry.shape:
        raise NotDirectlyReloadable(
            f"moved to another storage and reshaped from {list(entry.shape)} to {list(live.shape)}"
        )
    view = live.detach()
    return ResolvedTarget(
        entry.name,
        view,
        Relocation(
            entry.name,
            from_storage=entry.storage_ptr,
            from_offset=entry.storage_offset,
            to_storage=storage.data_ptr(),
            to_offset=int(live.storage_offset()),
        ),
    )


def overlapping_targets(
    targets: dict[str, ResolvedTarget], aliases: dict[str, list[str]]
) -> dict[str, str]:
    """Distinct weights whose write targets share bytes: writing one would clobber the other.

    Names tied at load (``aliases``) are one weight and may share bytes.
    """
    spans: dict[int, list[tuple[int, int, str]]] = {}
    covered: set[str] = set()
    for name, t in targets.items():
        if name in covered:
            continue
        covered.update(aliases.get(name, [name]))
        start, end = byte_span(t.view)
        spans.setdefault(storage_ptr(t.view), []).append((start, end, name))
    problems: dict[str, str] = {}
    for ranges in spans.values():
        ranges.sort()
        reach, holder = -1, ""
        for start, end, name in ranges:
            if start < reach:
                problems[name] = f"write target overlaps {holder!r} in the same storage"
            if end > reach:
                reach, holder = end, name
    return problems
