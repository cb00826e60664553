"""Validation of a whole checkpoint against the recorded layout, before the first byte."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ..checkpoint.live import LiveTensor
from ..layout import CheckpointLayout, TensorSpec
from .errors import DirectReloadError
from .parallel import run_split
from .write_map import WriteMap


def _convertible(src: torch.dtype, dst: torch.dtype) -> bool:
    """Casts allowed on reload: any float to any float (e.g. fp32 trainer -> bf16 engine)."""
    if src == dst:
        return True
    return src.is_floating_point and dst.is_floating_point


def preflight(
    layout: CheckpointLayout, specs: Mapping[str, TensorSpec], partial: bool = False
) -> dict[str, str]:
    """Problems of a checkpoint (name -> shape, dtype) against the recorded one; empty if fits.

    A ``partial`` checkpoint (applied on top of a version the model holds) may leave names out.
    """
    problems: dict[str, str] = {}
    expected = layout.checkpoint
    aliases = layout.aliases()
    for name, spec in specs.items():
        want = expected.get(name)
        if want is None:
            problems[name] = "unexpected tensor: the model loaded no tensor of this name"
        elif tuple(spec.shape) != tuple(want.shape):
            problems[name] = f"shape {list(spec.shape)} does not match {list(want.shape)}"
        elif not _convertible(spec.dtype, want.dtype):
            problems[name] = f"dtype {spec.dtype} cannot be converted to {want.dtype}"
    if partial:
        return problems
    for name in expected:
        if name in specs or name in layout.optional:
            continue
        if any(alias in specs for alias in aliases.get(name, ())):
            continue  # a tied name: its twin carries the bytes
        problems[name] = "missing from the checkpoint"
    return problems


# checkpoint name -> the copies this rank's loader takes of it (the write map's segments)
Written = Mapping[str, Sequence[Any]]


def learned_copies(write_map: WriteMap | None, addresses: object) -> Written | None:
    """The copies the loader takes of each checkpoint tensor, as the last complete write on
    these storages (``addresses``: the model's now) showed them; None where not known. A name
    the map cannot patch (its loader copied something computed from it) has none."""
    if write_map is None or write_map.addresses != addresses:
        return None
    return write_map.segments


def _read(t: torch.Tensor | LiveTensor, copies: Sequence[Any] | None) -> list[torch.Tensor]:
    """What the check reads of ``t`` on this rank. A tensor pushed from memory: the elements
    this rank writes, where ``copies`` say which (:meth:`LiveTensor.written_parts`), else the
    parts it holds (a DTensor's local shard, a whole plain tensor). Each rank checks its own and
    the update agrees on every rank's answer, so what any rank writes is checked once, not the
    whole tensor on every rank."""
    if not isinstance(t, LiveTensor):
        return [t]
    written = t.written_parts(copies) if copies else None
    return written if written is not None else t.parts


def _nonfinite(parts: list[torch.Tensor], target: torch.dtype | None) -> str | None:
    """Why the floating tensor of ``parts`` cannot be written into ``target``, or None."""
    found = (_nonfinite_part(part, target) for part in parts)
    return next((why for why in found if why is not None), None)


def _nonfinite_part(t: torch.Tensor, target: torch.dtype | None) -> str | None:
    """Why the floating tensor ``t`` cannot be written into ``target``, or None."""
    if not t.is_floating_point() or t.numel() == 0:
        return None
    if t.element_size() == 1:
        t = t.float()  # float8 kernels lack sum/isinf; one byte per element is cheap to widen
    if not math.isfinite(float(t.sum())):  # one pass; NaN and Inf propagate through it
        nan = int(torch.isnan(t).sum())
        inf = int(torch.isinf(t).sum())
        if nan or inf:
            return f"holds {nan} NaN and {inf} Inf values"
    if target is not None and target.is_floating_point:
        limit = torch.finfo(target).max
        if torch.finfo(t.dtype).max > limit and float(t.abs().max()) > limit:
            return f"holds values beyond the range of {target} (would become Inf)"
    return None


def find_nonfinite(
    weights: Iterable[tuple[str, torch.Tensor]],
    targets: Mapping[str, torch.dtype] | None = None,
    written: Written | None = None,
) -> dict[str, str]:
    """Names of floating tensors holding NaN or Inf, or values the engine's dtype cannot hold.

    A sum in the tensor's own dtype is one vectorised pass with no allocation (NaN and Inf
    propagate through it; it runs at memory bandwidth, where a float64 sum or ``isfinite`` is
    several times slower); only a non-finite sum (NaN/Inf, or an overflow of a large half-precision
    tensor) pays for the exact element-wise check. ``targets`` (name -> the dtype the tensor is
    written into) adds a range check where the cast narrows, e.g. float64 -> float32, since a
    finite value beyond the target's range would become Inf in the engine. ``written``
    (checkpoint name -> the copies this rank's loader takes of it: the write map learned on
    the storages written now) narrows a tensor pushed from memory to what this rank writes of
    it (:func:`_read`). The tensors are split across the push's threads (:mod:`.parallel`).
    """
    copies = written or {}
    items = [(name, _read(t, copies.get(name))) for name, t in weights]
    wanted = targets or {}

    def check(item: tuple[str, list[torch.Tensor]]) -> str | None:
        return _nonfinite(item[1], wanted.get(item[0]))

    def cost(item: tuple[str, list[torch.Tensor]]) -> int:
        return sum(p.numel() * p.element_size() for p in item[1])

    found = run_split(items, cost, check)
    bad: dict[str, str] = {}
    for (name, _), why in zip(items, found, strict=True):
        if isinstance(why, BaseException):
            raise why
        if why is not None:
            bad[name] = why
    return bad


def validate_checkpoint(
    layout: CheckpointLayout,
    items: list[tuple[str, torch.Tensor]],
    check_finite: bool = True,
    partial: bool = False,
    written: Written | None = None,
) -> None:
    """Refuse a whole checkpoint that does not fit ``layout``, before anything is written.

    Names, shapes and dtypes against the checkpoint recorded at load, then (``check_finite``)
    NaN/Inf and out-of-range values; a ``partial`` checkpoint may leave names out. Every reload
    path (direct or an engine's own) calls this first. ``written``: see :func:`find_nonfinite`.
    """
    specs: dict[str, TensorSpec] = {}
    problems: dict[str, str] = {}
    for name, t in items:
        if name in specs:
            problems[name] = "appears twice in the checkpoint"
        specs[name] = TensorSpec(tuple(t.shape), t.dtype)
    problems.update(preflight(layout, specs, partial))
    if check_finite and not problems:
        targets = {name: spec.dtype for name, spec in layout.checkpoint.items()}
        problems.update(find_nonfinite(items, targets, written))
    if problems:
        raise DirectReloadError("checkpoint rejected (nothing was written)", problems)
