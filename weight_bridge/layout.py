"""The checkpoint layout record: where every weight lived when the engine first loaded.

Recorded right after the checkpoint is loaded and *before* post-load processing, this is the one
source of truth that a direct reload resolves against. Each entry keeps the storage identity
(the untyped storage's data pointer) next to the offset, because an offset alone is meaningless
once post-load processing has moved a weight into another storage.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

__all__ = [
    "CheckpointLayout",
    "TensorLayout",
    "TensorSpec",
    "get_checkpoint_layout",
    "live_tensors",
    "record_checkpoint_layout",
    "storage_ptr",
]

LAYOUT_ATTR = "_weight_bridge_layout"


def storage_ptr(t: torch.Tensor) -> int:
    """Identity of the storage a tensor views (0 for storages with no memory)."""
    return int(t.untyped_storage().data_ptr())


@dataclass(frozen=True)
class TensorSpec:
    """What a checkpoint tensor must look like: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class TensorLayout:
    """Where one parameter or buffer lived at load time, in checkpoint layout."""

    name: str
    storage_ptr: int
    storage_nbytes: int
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    is_buffer: bool = False

    @classmethod
    def of(cls, name: str, t: torch.Tensor, is_buffer: bool = False) -> TensorLayout:
        return cls(
            name=name,
            storage_ptr=storage_ptr(t),
            storage_nbytes=t.untyped_storage().nbytes(),
            storage_offset=int(t.storage_offset()),
            shape=tuple(t.shape),
            stride=tuple(t.stride()),
            dtype=t.dtype,
            device=t.device,
            is_buffer=is_buffer,
        )

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


@dataclass
class CheckpointLayout:
    """Layout of every parameter/buffer name at load time, plus the checkpoint it came from.

    ``tensors`` holds one entry per *name*, tied and duplicate names included. ``checkpoint``
    lists the tensors a checkpoint for this model must contain (name -> shape, dtype); for an
    engine whose loader maps checkpoint names onto fused parameters (qkv, gate_up), these are the
    checkpoint's names, captured while the engine loaded, not the parameter names.
    """

    tensors: dict[str, TensorLayout]
    checkpoint: dict[str, TensorSpec]
    optional: frozenset[str] = field(default_factory=frozenset)

    def aliases(self) -> dict[str, list[str]]:
        """Names grouped by the exact bytes they view (tied weights share a group)."""
        groups: dict[tuple, list[str]] = {}
        for name, e in self.tensors.items():
            key = (e.storage_ptr, e.storage_offset, e.shape, e.stride, e.dtype)
            groups.setdefault(key, []).append(name)
        return {name: group for group in groups.values() for name in group}


def live_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """Every parameter and buffer under every name it has, as ``(name, tensor, is_buffer)``."""
    for name, p in model.named_parameters(remove_duplicate=False):
        yield name, p, False
    for name, b in model.named_buffers(remove_duplicate=False):
        yield name, b, True


def record_checkpoint_layout(
    model: torch.nn.Module,
    checkpoint: Mapping[str, TensorSpec] | None = None,
    optional: frozenset[str] | set[str] = frozenset(),
) -> CheckpointLayout:
    """Record every parameter/buffer's layout on ``model`` and return the record.

    Call it right after the weights are loaded and before post-load processing. ``checkpoint``
    names the tensors a checkpoint must hold; by default the parameter and buffer names
    themselves (the case of a plain module loaded by name). ``optional`` names checkpoint
    tensors that may be absent (e.g. non-persistent buffers).
    """
    tensors = {
        name: TensorLayout.of(name, t, is_buffer) for name, t, is_buffer in live_tensors(model)
    }
    if checkpoint is None:
        checkpoint = {n: TensorSpec(e.shape, e.dtype) for n, e in tensors.items()}
    layout = CheckpointLayout(
        tensors=tensors, checkpoint=dict(checkpoint), optional=frozenset(optional)
    )
    setattr(model, LAYOUT_ATTR, layout)
    return layout


def get_checkpoint_layout(model: torch.nn.Module) -> CheckpointLayout | None:
    """The layout recorded on ``model``, or None if none was recorded."""
    return getattr(model, LAYOUT_ATTR, None)
