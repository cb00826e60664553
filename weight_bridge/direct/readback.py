"""Proof after the push: every write read back from live storage and compared with its source.

While the model's own loader runs, a ``TorchFunctionMode`` notes each ``Tensor.copy_`` whose
destination lies in a storage the reload writes into (the loaders of vLLM and of plain modules
all end in one), together with the checkpoint tensor being loaded. When the loader moves on to
the next checkpoint tensor, the copies of the one it finished are *sealed*: what the read-back
will compare is kept (``"sampled"``: up to 8 rows of each source, first, last and spread
between; ``"full"``: a digest of each source as the destination holds it, cast to its dtype,
a few bytes: :func:`_digest`), the write map learns them (:class:`~.write_map.WriteMapLearner`),
and the source is let go. So a push holds its sources one at a time (a push from memory
produces and frees each tensor in turn), not the checkpoint. After the last write, each
destination is read back and compared: its kept rows (``"sampled"``), or the same digest of all
of its bytes (``"full"``). A later write that clobbered an earlier one (overlapping targets), a
write that went to a copy, or a cast that lost values shows up here and names the tensor:
anywhere in it under ``"full"``, in the kept rows under ``"sampled"``. ``"off"`` compares
nothing.

Every in-place write into those storages (``copy_``, indexing assignment, any other in-place
op) is also noted, whatever the mode, and :meth:`ReadBack.wrote_into` answers whether a view
was written: a complete push must have written every planned target, and a partial push
refreshes the derived state of the modules it wrote into, and only those.
"""

from __future__ import annotations

import bisect
import functools
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..exact import exact_fingerprint
from ..layout import byte_span, storage_ptr

READBACK_MODES = ("sampled", "full", "off")
_SAMPLE_ROWS = 8
_INPLACE_DUNDERS = frozenset(
    f"__{op}__" for op in ("setitem", "iadd", "isub", "imul", "itruediv", "ifloordiv", "ipow")
)
_IN_PLACE: dict[Any, bool] = {}
# in-place writes of constants (a loader zeroing vocabulary padding): they do not depend on the
# checkpoint, so a delta that leaves those elements alone stays exact
_CONSTANT_WRITES = frozenset({"fill_", "zero_"})


def _in_place(func: Any) -> bool:
    """Whether ``func`` writes into its first argument (``copy_``, ``__setitem__``...);
    decided once per function: a loader calls a few functions hundreds of times."""
    try:
        return _IN_PLACE[func]
    except KeyError:
        known = _IN_PLACE[func] = _named_in_place(func)
        return known
    except TypeError:  # not hashable: decide every time
        return _named_in_place(func)


def _named_in_place(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("_"))


def _rows(n: int) -> list[int]:
    if n <= _SAMPLE_ROWS:
        return list(range(n))
    step = (n - 1) / (_SAMPLE_ROWS - 1)
    return sorted({round(i * step) for i in range(_SAMPLE_ROWS)})


class ReadBack(TorchFunctionMode):
    """Notes writes into ``storages`` while active; :meth:`verify` compares them afterwards."""

    def __init__(
        self,
        storages: set[int],
        mode: str = "sampled",
        learn: Callable[[str, torch.Tensor | None, torch.Tensor, torch.Tensor], None] | None = None,
    ):
        super().__init__()
        if mode not in READBACK_MODES:
            raise ValueError(f"readback must be one of {READBACK_MODES}, not {mode!r}")
        self.mode = mode
        self.storages = storages
        self.learn = learn  # each copy, as its tensor is sealed: (name, source, dst, src)
        self.current = ""
        self.source: torch.Tensor | None = None  # the checkpoint tensor being loaded
        # sealed: (name, destination, what is kept of its source: the rows read back
        # ("sampled"), its digest ("full"), nothing ("off")); open: the tensor's copies
        self.writes: list[tuple[str, torch.Tensor, torch.Tensor | int | None]] = []
        self._open: list[tuple[str, torch.Tensor | None, torch.Tensor, torch.Tensor]] = []
        self.other_writes: set[str] = set()  # names also written by an in-place op not copy_
        self._spans: list[tuple[int, int]] = []  # bytes touched, in the order written
        self._merged: tuple[list[int], list[int]] | None = None

    def track(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, Any]]:
        """Pass ``weights`` through, remembering which checkpoint tensor is being loaded; the
        previous one's copies are sealed before the next is asked for."""
        pending = iter(weights)
        while True:
            self.seal()
            item = next(pending, None)
            if item is None:
                return
            self.current, self.source = item
            yield item
            del item

    def seal(self) -> None:
        """The copies noted so far: learned, and kept as what the final read-back compares
        (their rows, or their digests); their sources are let go."""
        with torch._C.DisableTorchFunction():  # what sealing computes is not the loader's
            for name, source, dst, src in self._open:
                if self.learn is not None:
                    self.learn(name, source, dst, src)
                kept: torch.Tensor | int | None = None
                if self.mode == "full":
                    kept = _digest(_as_written(dst, src))
                elif self.mode == "sampled":
                    kept = _kept(dst, src)
                self.writes.append((name, dst, kept))
        self._open = []
        self.source = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (
            args
            and _in_place(func)
            and isinstance(args[0], torch.Tensor)
            and storage_ptr(args[0]) in self.storages
        ):
            self._spans.append(byte_span(args[0]))
            self._merged = None
            if func is torch.Tensor.copy_ and len(args) >= 2 and isinstance(args[1], torch.Tensor):
                self._open.append((self.current, self.source, args[0], args[1]))
            elif getattr(func, "__name__", "") not in _CONSTANT_WRITES:
                self.other_writes.add(self.current)
        return out

    def wrote_into(self, view: torch.Tensor) -> bool:
        """Whether a noted write overlaps ``view``'s memory."""
        return self.wrote(byte_span(view))

    def wrote(self, span: tuple[int, int]) -> bool:
        """Whether a noted write overlaps the bytes ``span`` (a binary search over the merged
        spans written, so checking every target of a push stays linear in their number)."""
        if self._merged is None:
            starts: list[int] = []
            ends: list[int] = []
            for lo, hi in sorted(self._spans):
                if starts and lo <= ends[-1]:
                    ends[-1] = max(ends[-1], hi)
                else:
                    starts.append(lo)
                    ends.append(hi)
            self._merged = (starts, ends)
        starts, ends = self._merged
        lo, hi = span
        i = bisect.bisect_right(starts, hi - 1) - 1  # the last merged span starting before hi
        return i >= 0 and ends[i] > lo and hi > lo

    @torch.no_grad()
    def verify(self) -> dict[str, str]:
        """Checkpoint name -> what differs between a written view and its source, read back
        after the last write: every element (``"full"``) or the kept rows (``"sampled"``)."""
        self.seal()
        bad: dict[str, str] = {}
        if self.mode == "off":
            return bad
        for name, dst, kept in self.writes:
            assert kept is not None
            if isinstance(kept, int):  # "full": all of it, bit for bit
                if _digest(dst) != kept:
                    bad[name or "<unnamed>"] = _DIFFERS
            elif not _same(_rows_of(dst), kept, False):
                bad[name or "<unnamed>"] = _DIFFERS
        return bad


@functools.lru_cache(maxsize=256)
def _row_index(n: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(_rows(n), device=device)


_DIFFERS = (
    "read back after the push differs from the checkpoint (a later write overwrote it, or it "
    "went elsewhere)"
)


def _rows_of(t: torch.Tensor) -> torch.Tensor:
    """The rows of ``t`` the read-back compares (all of them for 8 rows or fewer)."""
    if t.dim() > 0 and t.shape[0] > _SAMPLE_ROWS:
        return t.index_select(0, _row_index(t.shape[0], t.device))
    return t


def _shaped(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``src`` in ``dst``'s shape, as ``dst.copy_(src)`` reads it (broadcast)."""
    if dst.shape != src.shape:
        src = src.expand_as(dst) if src.dim() <= dst.dim() else src.reshape(dst.shape)
    return src


def _as_written(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``src`` as ``dst.copy_(src)`` left it in ``dst``: in its shape, cast to its dtype on
    its device (``Tensor.to`` goes through the ``copy_`` the loader made, so the bits agree);
    a view of ``src`` when nothing changes, else a temporary of ``dst``'s size."""
    return _shaped(dst, src).to(device=dst.device, dtype=dst.dtype)


def _crc32(t: torch.Tensor) -> int:
    """CRC-32 of ``t``'s bytes in row-major order (a copy only where ``t`` is not contiguous)."""
    flat = t.detach().reshape(-1).contiguous()
    return zlib.crc32(flat.view(torch.uint8).numpy().data)  # releases the GIL


# the digest of a tensor's bits by device type; exact_fingerprint (on the device) elsewhere
_DIGESTS: dict[str, Callable[[torch.Tensor], int]] = {"cpu": _crc32}


def _digest(t: torch.Tensor) -> int:
    """What ``"full"`` compares: a digest of all of ``t``'s bits, where it lives. On the CPU a
    CRC-32 of its bytes (a pass at memory speed: the cost of a comparison), on an accelerator
    :func:`~weight_bridge.exact.exact_fingerprint` (int64 passes on the device, no transfer).
    Either changes with certainty when one element of up to 4 bytes changes (a burst of 32
    bits; an odd weight), and otherwise misses a difference with odds of 2**-32 (2**-64): a
    check against a loader's mistakes, which recur on every push, not an adversary."""
    return _DIGESTS.get(t.device.type, exact_fingerprint)(t)


def _kept(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """What the read-back keeps of a copy's source: its rows that :func:`_rows_of` reads of
    the destination, as the destination holds them (a copy: the source may be freed)."""
    src = _shaped(dst, src)
    rows = _rows_of(src)
    if rows is src:
        rows = src.clone()
    return rows.to(device=dst.device, dtype=dst.dtype)


def _same(dst: torch.Tensor, src: torch.Tensor, sampled: bool) -> bool:
    """Whether ``dst`` holds ``src``'s values (cast to ``dst``'s dtype): one comparison pass,
    no temporaries; the NaN-aware comparison only for a view that is not bit-equal."""
    src = _shaped(dst, src)
    if sampled and dst.dim() > 0 and dst.shape[0] > _SAMPLE_ROWS:
        dst = dst.index_select(0, _row_index(dst.shape[0], dst.device))
        src = src.index_select(0, _row_index(src.shape[0], src.device))
    if src.dtype != dst.dtype or src.device != dst.device:
        src = src.to(device=dst.device, dtype=dst.dtype)
    if torch.equal(dst, src):
        return True
    return dst.is_floating_point() and torch.allclose(dst, src, rtol=0.0, atol=0.0, equal_nan=True)
