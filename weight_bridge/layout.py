"""The checkpoint layout record: where every weight lived when the engine first loaded.

Recorded right after the checkpoint is loaded and *before* post-load processing (by
:func:`weight_bridge.direct.record_checkpoint_layout`), this is the one source of truth that a
direct reload resolves against. This module is the leaf of the package: plain records and the
functions that compute them from a tensor, importing nothing of the project.

Each entry keeps the storage identity (the untyped storage's data pointer) next to the offset,
because an offset alone is meaningless once post-load processing has moved a weight into
another storage, and a fingerprint of the values the loader wrote, because a storage that
moved may also have been *transformed* (transposed, rescaled, prepacked): only equal values
prove that a write in checkpoint layout reaches what the model computes with.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

_CHUNK = 1 << 16
_WEIGHTS: dict[torch.device, torch.Tensor] = {}


@dataclass(frozen=True)
class Fingerprint:
    """Three float64 sums of a tensor's values in logical (row-major) order.

    ``total`` and ``weighted`` (each element times a fixed pseudo-random weight that depends on
    its position) change under a rescale and under any permutation of positions, a transpose of
    a square weight included; ``squares`` sets the tolerance and catches sign flips. One pass,
    chunked, no full-size temporary.
    """

    total: float
    weighted: float
    squares: float
    numel: int

    def matches(self, other: Fingerprint, rtol: float = 1e-7) -> bool:
        if self.numel != other.numel:
            return False
        scale = math.sqrt(max(self.squares, other.squares) * max(self.numel, 1)) + 1e-30
        return (
            abs(self.total - other.total) <= rtol * scale
            and abs(self.weighted - other.weighted) <= 2 * rtol * scale
            and abs(self.squares - other.squares) <= rtol * (self.squares + 1e-30)
        )


def _position_weights(device: torch.device) -> torch.Tensor:
    w = _WEIGHTS.get(device)
    if w is None:
        g = torch.Generator().manual_seed(0x5EED)
        w = (torch.rand(_CHUNK, generator=g, dtype=torch.float64) + 0.5).to(device)
        _WEIGHTS[device] = w
    return w


@torch.no_grad()
def fingerprint(t: torch.Tensor) -> Fingerprint:
    """The :class:`Fingerprint` of ``t``'s values (any float or integer dtype, any strides).

    Blocks of 64 chunks are widened to float64 at a time (a bounded temporary), and the sums
    stay on the tensor's device until the end: one synchronisation per tensor on a GPU.
    """
    flat = t.detach().reshape(-1)
    w = _position_weights(flat.device)
    zero = torch.zeros((), dtype=torch.float64, device=flat.device)
    total, weighted, squares = zero.clone(), zero.clone(), zero.clone()
    block = 64 * _CHUNK
    for start in range(0, flat.numel(), block):
        part = flat[start : start + block].to(torch.float64)
        first = start // _CHUNK
        rows = -(-part.numel() // _CHUNK)
        padded = torch.nn.functional.pad(part, (0, rows * _CHUNK - part.numel()))
        per_chunk = padded.view(rows, _CHUNK) @ w  # each chunk's position-weighted sum
        # each chunk also gets its own factor, so chunks that swap places change the sum
        factors = 1.0 + 0.001 * torch.arange(first, first + rows, device=flat.device)
        total += part.sum()
        weighted += per_chunk @ factors.to(torch.float64)
        squares += part @ part
    return Fingerprint(float(total), float(weighted), float(squares), flat.numel())


def storage_ptr(t: torch.Tensor) -> int:
    """Identity of the storage a tensor views (0 for storages with no memory)."""
    return int(t.untyped_storage().data_ptr())


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes a (possibly strided) view may touch: from its first element to one past its
    last, as absolute addresses. Two views overlap exactly when their spans do (up to the gaps a
    stride leaves, which no write of ours relies on)."""
    start = t.data_ptr()
    if t.numel() == 0:
        return start, start
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()


def tie_key(t: torch.Tensor) -> object:
    """Tensors with equal keys view exactly the same bytes the same way: one weight under
    several names (tied embeddings and ``lm_head``), written and stored once. A ``DTensor`` is
    keyed by its local shard's storage (with its global shape); an empty tensor views no bytes
    and is tied to nothing (a key of its own)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    if not local.numel():
        return object()
    return (
        storage_ptr(local),
        int(local.storage_offset()),
        tuple(t.shape),
        tuple(local.stride()),
        t.dtype,
    )


def storage_start(t: torch.Tensor) -> tuple[str, int, int]:
    """Where a tensor's bytes begin: its device type, storage and offset. Two non-empty tensors
    with equal starts share storage (a writer refuses the second, a size estimate counts it
    once), whether or not they view it the same way (:func:`tie_key` says that)."""
    return (t.device.type, storage_ptr(t), int(t.storage_offset()))


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
    fingerprint: Fingerprint | None = None

    @classmethod
    def of(
        cls, name: str, t: torch.Tensor, is_buffer: bool = False, prove: bool = False
    ) -> TensorLayout:
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
            fingerprint=fingerprint(t) if prove and t.numel() > 0 else None,
        )

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def tie_key(self) -> tuple:
        """:func:`tie_key` of the tensor as it was recorded (an empty one keyed like any other)."""
        return (self.storage_ptr, self.storage_offset, self.shape, self.stride, self.dtype)


@dataclass
class CheckpointLayout:
    """Layout of every parameter/buffer name at load time, plus the checkpoint it came from.

    ``tensors`` holds one entry per *name*, tied and duplicate names included. ``checkpoint``
    lists the tensors a checkpoint for this model must contain (name -> shape, dtype); for an
    engine whose loader maps checkpoint names onto fused parameters (qkv, gate_up), these are the
    checkpoint's names, captured while the engine loaded, not the parameter names. ``loaded``:
    the names a complete reload must write (those of ``checkpoint``; None: every name).
    """

    tensors: dict[str, TensorLayout]
    checkpoint: dict[str, TensorSpec]
    optional: frozenset[str] = field(default_factory=frozenset)
    loaded: frozenset[str] | None = None

    def must_write(self, name: str) -> bool:
        """Whether a complete reload must write ``name``: a name of the checkpoint the engine
        loaded (``loaded``, when recorded; what a checkpoint never carries, such as default
        scales, is not), else every name."""
        return self.loaded is None or name in self.loaded

    def aliases(self) -> dict[str, list[str]]:
        """Names grouped by the exact bytes they view (tied weights share a group)."""
        groups: dict[tuple, list[str]] = {}
        for name, e in self.tensors.items():
            groups.setdefault(e.tie_key, []).append(name)
        return {name: group for group in groups.values() for name in group}


def live_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """Every parameter and buffer under every name it has, as ``(name, tensor, is_buffer)``."""
    for name, p in model.named_parameters(remove_duplicate=False):
        yield name, p, False
    for name, b in model.named_buffers(remove_duplicate=False):
        yield name, b, True
