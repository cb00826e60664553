"""The writer's reference copy: per synced tensor, the bits the engine was last pushed.

Why: a delta is the difference between what the engine holds and the trainer's current cast,
and an engine never sends its weights back. So the writer keeps, for every tensor a delta may
touch, the cast it last pushed (in the dtype of the checkpoint, which is the engine's: each
floating tensor in the dtype the engine reported holding it in, :mod:`.keyframes`) and the exact
fingerprint of it (:mod:`weight_bridge.exact`). A delta compares bit patterns (NaN and -0.0
compare exactly that way), writes what differs, and updates the copy in place; the fingerprint
of the new full tensor follows in O(changed) from the old one.

Where, and what it costs: **host memory**, one copy of the tracked tensors in the checkpoint's
dtype (a bf16 engine: 2 bytes per element, half the trainer's fp32 master weights). For a trainer
on an accelerator the copy is *pinned* host memory, not device memory: device memory is what the
trainer is short of, and every sync copies its cast off the device anyway (into the file, or
here to be compared), which pinned memory takes at the link's speed. Only the writer holds it:
the Lightning callback's writer rank, ``WeightBridgeTrainer``'s sender (rank 0). It is never
saved (a resumed run, a restarted trainer, starts with a keyframe).

The tensors are walked :data:`CHUNK` elements at a time, so the extra memory is one chunk and
the changed elements' indices and values, never a full-size cast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from ..exact import bits_of, exact_fingerprint, fingerprint_change
from .format import encode_sparse, sparse_bytes

CHUNK = 1 << 22  # elements per step (a bool mask of 4 MiB, a bf16 chunk of 8 MiB)
_MASK = (1 << 64) - 1


@dataclass
class Change:
    """What a delta carries for one tensor: ``changed`` of its ``numel`` elements differ from
    the reference; ``fingerprint``: of the full new tensor. Stored ``sparse`` (the three parts of
    :func:`~weight_bridge.delta.format.encode_sparse`) or ``dense`` (the reference's own
    tensor, already holding the new values); both None when nothing changed."""

    numel: int
    changed: int
    fingerprint: int
    sparse: dict[str, torch.Tensor] | None = None
    dense: torch.Tensor | None = None


def _host_empty(shape: torch.Size | tuple[int, ...], dtype: torch.dtype, pinned: bool):
    if pinned:
        with contextlib.suppress(RuntimeError):  # no pinning backend: plain host memory
            return torch.empty(shape, dtype=dtype, pin_memory=True)
    return torch.empty(shape, dtype=dtype)


def _chunks(flat: torch.Tensor, dtype: torch.dtype) -> Iterator[tuple[int, torch.Tensor]]:
    """``(start, chunk)`` over ``flat`` cast to ``dtype``, on ``flat``'s device."""
    for start in range(0, flat.numel(), CHUNK):
        yield start, flat[start : start + CHUNK].to(dtype)


@torch.no_grad()
def cast_fingerprint(tensor: torch.Tensor, dtype: torch.dtype) -> int:
    """The exact fingerprint of ``tensor`` cast to ``dtype``, without a full-size cast copy
    (chunk by chunk, on the tensor's device): a keyframe's tensor that is not kept."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype == dtype and flat.numel() <= CHUNK:
        return exact_fingerprint(flat)
    total = 0
    for start, chunk in _chunks(flat, dtype):
        index = torch.arange(start, start + chunk.numel(), device=chunk.device)
        total += fingerprint_change(index, torch.zeros_like(chunk), chunk)
    return total & _MASK


def _whole_fingerprint(src: torch.Tensor, held: torch.Tensor) -> int:
    """The fingerprint of ``held`` (``src`` cast), taken where it is cheaper: on the trainer's
    accelerator from ``src`` (the same bits, so the same value), else on the host copy."""
    if src.device.type == "cpu":
        return exact_fingerprint(held)
    return cast_fingerprint(src, held.dtype)


class Reference:
    """Per tracked tensor (checkpoint name), the last pushed cast on the host and its
    fingerprint. :meth:`store` (a keyframe) and :meth:`diff` (a delta) update it as the tensors
    stream by; :meth:`invalidate` after anything that may leave it unlike the engine (an
    aborted save, a failed push): buffers are kept for the next keyframe to fill, but no delta
    is taken against them."""

    def __init__(self) -> None:
        self._held: dict[str, torch.Tensor] = {}
        self._prints: dict[str, int] = {}  # valid entries only
        self._bounce: torch.Tensor | None = None  # pinned chunk of device casts (diff)
        # the lineage (delta.lineage_of) of the weights last written, while they are trusted
        self.lineage: str | None = None

    @property
    def nbytes(self) -> int:
        """Host memory held (valid or not)."""
        return sum(t.numel() * t.element_size() for t in self._held.values())

    @property
    def names(self) -> list[str]:
        """The tensors a delta can be taken against."""
        return list(self._prints)

    def fingerprint(self, name: str) -> int | None:
        return self._prints.get(name)

    def tensor(self, name: str) -> torch.Tensor | None:
        """The held cast of ``name`` if valid (the bits last pushed)."""
        return self._held[name] if name in self._prints else None

    def invalidate(self) -> None:
        self._prints.clear()
        self.lineage = None

    def keep_only(self, names: Iterable[str]) -> None:
        """Free what is not in ``names`` (after a keyframe: tensors no longer synced)."""
        keep = set(names)
        for name in [n for n in self._held if n not in keep]:
            del self._held[name]
            self._prints.pop(name, None)

    def clear(self) -> None:
        """Free everything (the run is over)."""
        self._held.clear()
        self._prints.clear()
        self._bounce = None
        self.lineage = None

    @torch.no_grad()
    def store(self, name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Keep ``tensor`` cast to ``dtype`` (reusing the buffer of the same shape and dtype)
        and its fingerprint; returns the held copy (what a keyframe then writes)."""
        src = tensor.detach()
        self._prints.pop(name, None)
        held = self._held.get(name)
        if held is None or held.shape != src.shape or held.dtype != dtype:
            self._held.pop(name, None)  # the old buffer goes before the new one is made
            held = _host_empty(src.shape, dtype, pinned=src.device.type != "cpu")
            self._held[name] = held
        if src.device.type == "cpu":
            held.copy_(src)  # cast on the way (round to nearest even), torch's threads
        else:
            flat = held.view(-1)
            for start, chunk in _chunks(src.reshape(-1), dtype):  # cast on the device
                flat[start : start + chunk.numel()].copy_(chunk)
        self._prints[name] = _whole_fingerprint(src, held)
        return held

    def _host_chunks(
        self, flat: torch.Tensor, dtype: torch.dtype
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """The cast chunks of ``flat`` on the host (a device's through a pinned buffer)."""
        if flat.device.type == "cpu":
            yield from _chunks(flat, dtype)
            return
        if self._bounce is None or self._bounce.numel() < CHUNK * 8:
            self._bounce = _host_empty((CHUNK * 8,), torch.uint8, pinned=True)
        for start, chunk in _chunks(flat, dtype):
            buf = self._bounce[: chunk.numel() * chunk.element_size()].view(dtype)
            buf.copy_(chunk)
            yield start, buf

    @torch.no_grad()
    def diff(
        self, name: str, tensor: torch.Tensor, dtype: torch.dtype, sparse: bool = True
    ) -> Change | None:
        """Compare ``tensor`` cast to ``dtype`` with the held copy, bit for bit, and bring the
        copy up to date. None when there is no valid copy of that shape and dtype (the caller
        then stores the tensor whole: :meth:`store`). Sparse parts are kept while sparse is the
        smaller form (and allowed: ``sparse``); past that the tensor is dense and its
        fingerprint taken whole."""
        held = self._held.get(name)
        if name not in self._prints or held is None:
            return None
        src = tensor.detach()
        if held.shape != src.shape or held.dtype != dtype:
            return None
        ref, numel, itemsize = held.view(-1), held.numel(), held.element_size()
        fingerprint = self._prints.pop(name)  # invalid until the update is complete
        changed = 0
        indices: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for start, new in self._host_chunks(src.reshape(-1), dtype):
            old = ref[start : start + new.numel()]
            at = (bits_of(new) != bits_of(old)).nonzero().squeeze(1)
            if not at.numel():
                continue
            changed += at.numel()
            sparse = sparse and sparse_bytes(numel, changed, itemsize) < numel * itemsize
            if not sparse:
                indices, values = [], []
                old.copy_(new)
                continue
            now = new[at]
            fingerprint += fingerprint_change(at + start, old[at], now)
            old[at] = now
            indices.append(at + start)
            values.append(now)
        if not sparse:
            fingerprint = _whole_fingerprint(src, held)
        fingerprint &= _MASK
        self._prints[name] = fingerprint
        if not changed:
            return Change(numel, 0, fingerprint)
        if not sparse:
            return Change(numel, changed, fingerprint, dense=held)
        parts = encode_sparse(torch.cat(indices), torch.cat(values), numel)
        return Change(numel, changed, fingerprint, sparse=parts)
