"""Validation of a whole checkpoint against the recorded layout, before the first byte."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from ..checkpoint.live import LiveTensor
from ..layout import CheckpointLayout, TensorSpec
from .errors import DirectReloadError
from .parallel import run_split


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


def _nonfinite(t: torch.Tensor | LiveTensor, target: torch.dtype | None) -> str | None:
    """Why the floating tensor ``t`` cannot be written into ``target``, or None. A tensor
    pushed from memory is checked in the parts this rank holds (a DTensor's local shard: the
    other ranks check theirs, and the update agrees on every rank's answer)."""
    if isinstance(t, LiveTensor):
        found = (_nonfinite(part, target) for part in t.parts)
        return next((why for why in found if why is not None), None)
    if not t.is_floating_point() or t.numel() == 0:
        return None
    if t.element_size() == 1:
        t = t.float()  # float8 kernels lack sum/isinf; one byte per element is cheap to widen
    if not torch.isfinite(t.sum()):
        nan = int(torch.isnan(t).sum())
        inf = int(torch.isinf(t).sum())
        if nan or inf:
            return f"holds {nan} NaN and {inf} Inf values"
    if target is not None and target.is_floating_point:
        limit = torch.finfo(target).max
        if torch.finfo(t.dtype).max > limit and float(t.abs().max()) > limit:
            return f"holds values beyond the range of {target} (would become Inf)"
    return None


def _nbytes(t: torch.Tensor | LiveTensor) -> int:
    parts = t.parts if isinstance(t, LiveTensor) else [t]
    return sum(p.numel() * p.element_size() for p in parts)


def find_nonfinite(
    weights: Iterable[tuple[str, torch.Tensor]],
    targets: Mapping[str, torch.dtype] | None = None,
) -> dict[str, str]:
    """Names of floating tensors holding NaN or Inf, or values the engine's dtype cannot hold.

    A sum in the tensor's own dtype is one vectorised pass with no allocation (NaN and Inf
    propagate through it; it runs at memory bandwidth, where a float64 sum or ``isfinite`` is
    5-20x slower); only a non-finite sum (NaN/Inf, or an overflow of a large half-precision
    tensor) pays for the exact element-wise check. ``targets`` (name -> the dtype the tensor is
    written into) adds a range check where the cast narrows, e.g. float64 -> float32, since a
    finite value beyond the target's range would become Inf in the engine. The tensors are
    split across the push's threads (:mod:`.parallel`).
    """
    items = list(weights)
    wanted = targets or {}

    def check(item: tuple[str, torch.Tensor]) -> str | None:
        return _nonfinite(item[1], wanted.get(item[0]))

    found = run_split(items, lambda item: _nbytes(item[1]), check)
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
) -> None:
    """Refuse a whole checkpoint that does not fit ``layout``, before anything is written.

    Names, shapes and dtypes against the checkpoint recorded at load, then (``check_finite``)
    NaN/Inf and out-of-range values; a ``partial`` checkpoint may leave names out. Every reload
    path (direct or an engine's own) calls this first.
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
        problems.update(find_nonfinite(items, targets))
    if problems:
        raise DirectReloadError("checkpoint rejected (nothing was written)", problems)
