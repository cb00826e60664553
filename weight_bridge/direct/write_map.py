"""Where each checkpoint element lands in live storage: learned from a complete write.

Why: a delta changes a few elements per tensor; calling the model's loader for them would
rewrite whole tensors (and a loader cannot take a scattered subset anyway). But a complete
write already shows exactly where every element goes: each ``Tensor.copy_`` the loader made
(noted by :class:`~.readback.ReadBack`) copies a *view of the checkpoint tensor* (a narrow for
a tensor-parallel shard, a slice of a fused qkv or gate_up tensor, one expert of an MoE) into a
*view of a live storage* (a fused parameter at an offset, an expert slot, a tied embedding). A
:class:`Segment` keeps both views' geometry; with it, a flat index of the checkpoint tensor is
mapped to an element of live storage in O(1), so a delta is applied in O(changed) writes.

A name whose loader did anything else (copied a *new* tensor made from the checkpoint one, a
cast, a concatenation, a permutation through ``contiguous``; wrote by another in-place op; or
copied with a geometry that cannot be inverted element by element) gets no segments: it is
*not patchable*, and a delta must carry it dense (the engine refuses a sparse one by name).
The map is only valid for the storages it was learned on: :class:`WriteMapLearner` records the
model's addresses, and a push checks them (a direct reload never moves one).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from ..exact import fingerprint_change
from ..layout import byte_span, storage_ptr
from .positions import CHUNK, Positions


@dataclass(frozen=True)
class Segment:
    """One copy the loader made: checkpoint elements ``src_offset + sum(m[d] * src_stride[d])``
    went to live elements ``dst_offset + sum(m[d] * dst_stride[d])`` of ``storage`` (a flat
    view of the whole live storage in the written dtype), for every ``m`` within ``shape``."""

    storage: torch.Tensor
    src_offset: int
    src_stride: tuple[int, ...]
    dst_offset: int
    dst_stride: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def extent(self) -> int:
        """One past the last checkpoint element the segment reads, from ``src_offset``."""
        return 1 + sum((n - 1) * s for n, s in zip(self.shape, self.src_stride, strict=True))

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def live(self) -> torch.Tensor:
        """The live elements the segment wrote, as a view of ``storage`` of ``shape``."""
        return self.storage.as_strided(self.shape, self.dst_stride, self.dst_offset)

    @property
    def linear(self) -> bool:
        """Whether the segment copies one run of consecutive checkpoint elements into one run
        of consecutive live elements, in order (a whole tensor, a tensor-parallel shard along
        the first dimension, a slice of a fused qkv or gate_up): element ``src_offset + k``
        lands on ``dst_offset + k``."""
        return _contiguous(self.shape, self.src_stride) and _contiguous(self.shape, self.dst_stride)

    def _range(self, flat: torch.Tensor) -> tuple[int, int]:
        """Where in ``flat`` (sorted) the indices this segment may hold are: two binary
        searches."""
        bounds = torch.tensor([self.src_offset, self.src_offset + self.extent], dtype=flat.dtype)
        lo, hi = (int(i) for i in torch.searchsorted(flat, bounds))
        return lo, hi

    def _solve(self, rel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For checkpoint positions ``rel`` (from ``src_offset``, int64) of a segment that is
        not linear: which the segment holds, and the live element of each (int64)."""
        ok = torch.ones_like(rel, dtype=torch.bool)
        dst = torch.full_like(rel, self.dst_offset)
        order = sorted(range(len(self.shape)), key=lambda d: -self.src_stride[d])
        for d in order:  # nested strides: each coordinate is the quotient, greedily
            m = torch.div(rel, self.src_stride[d], rounding_mode="floor")
            ok &= (m >= 0) & (m < self.shape[d])
            rel = rel - m * self.src_stride[d]
            dst += m * self.dst_stride[d]
        ok &= rel == 0
        return ok, dst

    def positions(self, flat: torch.Tensor) -> tuple[Held, Positions]:
        """For checkpoint flat indices ``flat`` (sorted, int64): which of them the segment
        holds and the live elements they land on, kept small (:mod:`.positions`) and computed
        a chunk at a time, never all as int64 at once. Sorted indices put the ones a segment can
        hold in one range (two binary searches); a linear segment holds all of that range and
        shifts it, any other is solved coordinate by coordinate."""
        lo, hi = self._range(flat)
        if hi <= lo:
            return Held(lo, hi, None), Positions.of(flat[:0])
        if self.linear:
            shift = self.dst_offset - self.src_offset
            chunks = (flat[s : min(s + CHUNK, hi)] + shift for s in range(lo, hi, CHUNK))
            first, last = int(flat[lo]) + shift, int(flat[hi - 1]) + shift
            return Held(lo, hi, None), Positions.sorted_chunks(chunks, hi - lo, first, last)
        return self._solved_positions(flat, lo, hi)

    def _solved_positions(self, flat: torch.Tensor, lo: int, hi: int) -> tuple[Held, Positions]:
        """:meth:`positions` of a segment that is not linear, in two passes over chunks of
        ``flat[lo:hi]``: which are held, how many, and whether they land in increasing order;
        then the positions themselves, straight into their encoding (4-byte plain ones if they
        do not increase)."""

        def solved() -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
            for start in range(lo, hi, CHUNK):
                end = min(start + CHUNK, hi)
                ok, dst = self._solve(flat[start:end] - self.src_offset)
                yield start - lo, end - lo, ok, dst[ok]

        mask = torch.empty(hi - lo, dtype=torch.bool)
        count, first, last, increasing = 0, 0, -1, True
        for start, end, ok, where in solved():
            mask[start:end] = ok
            if where.numel():
                first = int(where[0]) if not count else first
                increasing = increasing and int(where[0]) > last
                increasing = increasing and bool((where[1:] > where[:-1]).all())
                last, count = int(where[-1]), count + where.numel()
        if not count:
            return Held(lo, hi, mask), Positions.of(flat[:0])
        if increasing:
            chunks = (where for _, _, _, where in solved())
            return Held(lo, hi, mask), Positions.sorted_chunks(chunks, count, first, last)
        narrow = torch.int32 if self.storage.numel() < 2**31 else torch.int64  # any position
        plain = torch.empty(count, dtype=narrow)
        done = 0
        for _, _, _, where in solved():
            plain[done : done + where.numel()] = where
            done += where.numel()
        return Held(lo, hi, mask), Positions(plain=plain)


@dataclass(frozen=True)
class Held:
    """Which of a sorted index list a segment holds: positions ``lo:hi``, of those the ones
    ``mask`` keeps (None: all)."""

    lo: int
    hi: int
    mask: torch.Tensor | None

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """The held elements of ``t`` (aligned with the index list): a view when unmasked; else
        selected a chunk at a time (a mask's selection builds int64 indices of it all)."""
        part = t[self.lo : self.hi]
        if self.mask is None:
            return part
        out = torch.empty(int(torch.count_nonzero(self.mask)), dtype=t.dtype, device=t.device)
        done = 0
        for start in range(0, part.numel(), CHUNK):
            chosen = part[start : start + CHUNK][self.mask[start : start + CHUNK]]
            out[done : done + chosen.numel()] = chosen
            done += chosen.numel()
        return out

    def covers(self, n: int) -> bool:
        """Whether it holds all ``n`` indices."""
        return self.lo == 0 and self.hi == n and (self.mask is None or bool(self.mask.all()))


def _contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether a view of ``shape`` with ``stride`` is row-major without gaps."""
    expected = 1
    for n, st in reversed(list(zip(shape, stride, strict=True))):
        if n != 1 and st != expected:
            return False
        expected *= n
    return True


@dataclass
class WriteMap:
    """Checkpoint name -> its segments; names the map cannot patch -> why; the dtype each
    name is held in; the model parameters each writes into; the addresses it was learned on."""

    segments: dict[str, list[Segment]] = field(default_factory=dict)
    unpatchable: dict[str, str] = field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    params: dict[str, set[str]] = field(default_factory=dict)
    addresses: object = None

    def whole(self, name: str, numel: int) -> bool:
        """Whether this worker holds every element of ``name`` (not a tensor-parallel shard)."""
        return sum(s.numel for s in self.segments.get(name, ())) >= numel


def _nested(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether a view's strides can be inverted greedily (each stride at least the span of
    the dimensions with smaller strides: what narrow, select and slicing of a contiguous
    tensor give)."""
    dims = sorted(((st, n) for n, st in zip(shape, stride, strict=True) if n > 1), reverse=True)
    span = 1
    for st, n in reversed(dims):
        if st < span:
            return False
        span = st * n
    return True


def _flat_storage(dst: torch.Tensor, cache: dict) -> torch.Tensor:
    key = (storage_ptr(dst), dst.dtype, dst.device)
    flat = cache.get(key)
    if flat is None:
        storage = dst.untyped_storage()
        n = storage.nbytes() // dst.element_size()
        flat = torch.empty(0, dtype=dst.dtype, device=dst.device).set_(storage, 0, (n,), (1,))
        cache[key] = flat
    return flat


def _segment(
    source: torch.Tensor, dst: torch.Tensor, src: torch.Tensor, cache: dict
) -> Segment | str:
    """The segment of one noted copy, or why it cannot be one."""
    if src.dtype != source.dtype:
        return f"its loader copies a {src.dtype} view of a {source.dtype} tensor"
    if tuple(src.shape) != tuple(dst.shape):
        return f"its loader copies shape {tuple(src.shape)} into {tuple(dst.shape)}"
    if not source.is_contiguous() or src.numel() == 0:
        return "an empty or non-contiguous checkpoint tensor"
    if storage_ptr(src) != storage_ptr(source):
        return "its loader copies a new tensor computed from it (transformed), not a view"
    delta = src.data_ptr() - source.data_ptr()
    if delta < 0 or delta % source.element_size():
        return "its loader copies a view outside the tensor"
    if not _nested(tuple(src.shape), tuple(src.stride())):
        return f"its loader copies a view with strides {tuple(src.stride())}"
    return Segment(
        _flat_storage(dst, cache),
        delta // source.element_size(),
        tuple(src.stride()),
        int(dst.storage_offset()),
        tuple(dst.stride()),
        tuple(src.shape),
    )


class WriteMapLearner:
    """Learns the write map of a complete write as it happens, one checkpoint tensor at a time
    (the read-back hands over each tensor's copies when it moves on: a source need not outlive
    its write, so a push from memory can produce its tensors one by one). ``targets``: each
    parameter's bytes (the plan's spans), to name the parameters a checkpoint tensor writes
    into; ``addresses``: the storages it is learned on."""

    def __init__(self, targets: Mapping[str, tuple[int, int]], addresses: object) -> None:
        self.out = WriteMap(addresses=addresses)
        self.cache: dict = {}
        self.spans = sorted((lo, hi, name) for name, (lo, hi) in targets.items())
        self.starts = [lo for lo, _, _ in self.spans]

    def note(self, name: str, source: torch.Tensor | None, dst: torch.Tensor, src: torch.Tensor):
        """One copy the loader made of (a view of) ``source``, checkpoint tensor ``name``, into
        the live view ``dst``."""
        out = self.out
        if source is None or name in out.unpatchable:
            return
        seg = _segment(source, dst, src, self.cache)
        if isinstance(seg, str):
            out.unpatchable[name] = seg
            out.segments.pop(name, None)
            return
        out.segments.setdefault(name, []).append(seg)
        lo, _ = byte_span(dst)
        i = bisect.bisect_right(self.starts, lo) - 1
        if i >= 0 and self.spans[i][1] > lo:
            out.params.setdefault(name, set()).add(self.spans[i][2])
        out.dtypes.setdefault(name, dst.dtype)
        if out.dtypes[name] != dst.dtype:
            out.unpatchable[name] = "its loader writes it into storages of several dtypes"
            out.segments.pop(name, None)

    def finish(self, other_writes: Iterable[str]) -> WriteMap:
        """The map, once the write ended: ``other_writes``, names also written by an in-place
        op that is not a copy of a view, are not patchable."""
        out = self.out
        for name in other_writes:
            out.unpatchable[name] = "its loader writes it with an in-place op other than copy_"
            out.segments.pop(name, None)
            out.params.pop(name, None)
        for name in out.unpatchable:
            out.dtypes.pop(name, None)
        return out


def held_tensor(write_map: WriteMap | None, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The full checkpoint tensor ``name`` as live storage holds it (this worker holds it
    whole), gathered through its segments."""
    assert write_map is not None
    segments = write_map.segments[name]
    numel = 1
    for s in shape:
        numel *= s
    out = torch.empty(numel, dtype=segments[0].storage.dtype, device=segments[0].storage.device)
    for seg in segments:
        out.as_strided(seg.shape, seg.src_stride, seg.src_offset).copy_(seg.live())
    return out.view(shape)


_CHUNK = 1 << 22  # checkpoint elements weighed at a time by held_fingerprint (32 MiB of int64)


@torch.no_grad()
def held_fingerprint(write_map: WriteMap | None, name: str) -> tuple[int, int]:
    """This worker's part of the full fingerprint of checkpoint tensor ``name``, read from
    live storage, and how many of its elements it holds: the sum over every segment of its
    live elements weighed at their checkpoint positions (an element two segments hold counts
    twice). Summed over the ranks of a tensor-parallel engine, the parts give ``m`` times the
    full tensor's fingerprint when every element is held ``m`` times: how ``readback="full"``
    reads a sharded tensor back whole without gathering it."""
    assert write_map is not None
    total, count = 0, 0
    for seg in write_map.segments[name]:
        total += segment_fingerprint(seg, seg.live())  # weighed where it lives
        count += seg.numel
    return total & ((1 << 64) - 1), count


@torch.no_grad()
def segment_fingerprint(seg: Segment, values: torch.Tensor) -> int:
    """``values`` (of the segment's shape: its live view, its pre-images, or its view of a
    dense delta's values) weighed at the checkpoint positions the segment maps them from: its
    part of a full fingerprint. Chunked along the first dimension, so the positions' int64
    temporary stays bounded (:data:`_CHUNK` elements), on the values' device."""
    device = values.device
    if not seg.shape:  # one element
        at = torch.tensor([seg.src_offset], dtype=torch.int64, device=device)
        return fingerprint_change(at, torch.zeros_like(values.reshape(1)), values.reshape(1))
    total = 0
    inner = torch.zeros((), dtype=torch.int64, device=device)  # positions in one row
    for d in range(1, len(seg.shape)):
        shape = [1] * (len(seg.shape) - 1)
        shape[d - 1] = seg.shape[d]
        step = torch.arange(seg.shape[d], device=device) * seg.src_stride[d]
        inner = inner + step.view(shape)
    per_row = max(1, seg.numel // max(seg.shape[0], 1))
    rows = max(1, _CHUNK // per_row)
    for first in range(0, seg.shape[0], rows):
        n = min(rows, seg.shape[0] - first)
        rows_at = torch.arange(first, first + n, device=device) * seg.src_stride[0]
        starts = seg.src_offset + rows_at
        at = (starts.view([n] + [1] * (len(seg.shape) - 1)) + inner).reshape(-1)
        part = values[first : first + n].reshape(-1)
        total += fingerprint_change(at, torch.zeros_like(part), part)
    return total & ((1 << 64) - 1)
