"""Direct reload: write a checkpoint straight into a model's live storages, in place.

The model's parameters are temporarily re-pointed at views, in checkpoint layout, of the
storages they live in *now*; the model's own loading path (``load_weights`` with its fused
qkv / gate_up loaders, tensor-parallel narrowing and tied names) then writes through those views,
and the original views are restored. Nothing is re-allocated and post-load processing is not
re-run, so every address stays put (CUDA graphs stay valid).

How a name's write target is resolved (:func:`resolve_target`):

1. Same storage as at load (pointer and size unchanged): the recorded offset, shape and stride.
   This covers in-place view transforms (transpose, narrow) done after load.
2. Moved to another storage with the same shape and dtype: the weight's *current* offset and
   stride. The recorded offset belongs to the old storage; reusing it would overwrite a
   neighbour in the new one (vLLM PR 65281).
3. Anything else (storage emptied or packed into a kernel format, dtype changed, moved *and*
   reshaped, device changed, targets overlapping another weight) is refused by name at ``begin``,
   before a byte is written.

Limitations:
1. Processing that derives *other* state from a weight (a packed copy, a scale) is not re-run;
   engines must refresh such state after :func:`finish_direct_reload` or avoid creating it.
2. A storage freed and re-allocated at the same address with the same size is taken as unchanged.
3. Names are checked against the checkpoint recorded at load; a loader that maps names
   differently on reload than on load is not detected.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from .layout import (
    CheckpointLayout,
    TensorLayout,
    TensorSpec,
    get_checkpoint_layout,
    live_tensors,
    storage_ptr,
)

__all__ = [
    "DirectReloadError",
    "ReloadPlan",
    "ReloadReport",
    "Relocation",
    "ResolvedTarget",
    "begin_direct_reload",
    "check_finite",
    "clear_undefined",
    "direct_reload",
    "finish_direct_reload",
    "mark_undefined",
    "plan_direct_reload",
    "preflight",
    "resolve_target",
    "undefined_reason",
    "validate_checkpoint",
]

SESSION_ATTR = "_weight_bridge_session"
UNDEFINED_ATTR = "_weight_bridge_undefined"

Weights = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


class DirectReloadError(RuntimeError):
    """A direct reload was refused (nothing written) or failed (model marked undefined).

    ``problems`` maps each offending tensor name to what is wrong with it.
    """

    def __init__(self, message: str, problems: Mapping[str, str] | None = None):
        self.problems = dict(problems or {})
        if self.problems:
            listed = "\n".join(f"  {n}: {why}" for n, why in sorted(self.problems.items()))
            message = f"{message}\n{listed}"
        super().__init__(message)

    @property
    def names(self) -> list[str]:
        return sorted(self.problems)


class NotDirectlyReloadable(Exception):
    """Why one weight cannot be written in place (raised by :func:`resolve_target`)."""


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


@dataclass
class ReloadPlan:
    """Every name resolved (``targets``) or refused (``problems``), before anything is written."""

    targets: dict[str, ResolvedTarget]
    problems: dict[str, str]

    @property
    def relocations(self) -> list[Relocation]:
        return [t.relocation for t in self.targets.values() if t.relocation is not None]


@dataclass
class ReloadReport:
    """What a direct reload wrote and how long it took."""

    tensors: int = 0
    bytes: int = 0
    relocations: list[Relocation] = field(default_factory=list)
    preflight_s: float = 0.0
    write_s: float = 0.0
    elapsed_s: float = 0.0
    recovered_from_undefined: str | None = None


@dataclass
class _Session:
    plan: ReloadPlan
    saved: dict[int, tuple[torch.Tensor, torch.Tensor]]  # id -> (tensor object, original data)
    addresses: dict[str, tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]]
    started: float
    was_undefined: str | None


def _addresses(model: torch.nn.Module) -> dict:
    return {
        name: (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        for name, t, _ in live_tensors(model)
    }


def _extent(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements spanned by a strided view, from its first to one past its last element."""
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True))


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


def _overlaps(targets: dict[str, ResolvedTarget], aliases: dict[str, list[str]]) -> dict[str, str]:
    """Distinct weights whose write targets share bytes: writing one would clobber the other.

    Names tied at load (``aliases``) are one weight and may share bytes.
    """
    spans: dict[int, list[tuple[int, int, str]]] = {}
    covered: set[str] = set()
    for name, t in targets.items():
        if name in covered:
            continue
        covered.update(aliases.get(name, [name]))
        v = t.view
        start = int(v.storage_offset()) * v.dtype.itemsize
        end = start + _extent(tuple(v.shape), tuple(v.stride())) * v.dtype.itemsize
        spans.setdefault(storage_ptr(v), []).append((start, end, name))
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


def plan_direct_reload(model: torch.nn.Module) -> ReloadPlan:
    """Resolve every recorded name without writing anything (a dry run of ``begin``)."""
    layout = _require_layout(model)
    live = {name: (t, is_buffer) for name, t, is_buffer in live_tensors(model)}
    targets: dict[str, ResolvedTarget] = {}
    problems: dict[str, str] = {}
    for name, entry in layout.tensors.items():
        if entry.is_buffer and name not in layout.checkpoint:
            continue  # derived buffers (rotary caches...) are never written by a reload
        if name not in live:
            problems[name] = "no longer exists in the model"
            continue
        try:
            targets[name] = resolve_target(entry, live[name][0])
        except NotDirectlyReloadable as why:
            problems[name] = str(why)
    problems.update(_overlaps(targets, layout.aliases()))
    return ReloadPlan(targets, problems)


def _require_layout(model: torch.nn.Module) -> CheckpointLayout:
    layout = get_checkpoint_layout(model)
    if layout is None:
        raise DirectReloadError(
            "no checkpoint layout recorded on this model: call record_checkpoint_layout(model) "
            "right after its weights are first loaded"
        )
    return layout


def undefined_reason(model: torch.nn.Module) -> str | None:
    """Why the model's weights are undefined (a reload failed mid-way), or None."""
    return getattr(model, UNDEFINED_ATTR, None)


def mark_undefined(model: torch.nn.Module, reason: str) -> None:
    """Flag the weights as half-written until a complete reload succeeds."""
    setattr(model, UNDEFINED_ATTR, reason)


def clear_undefined(model: torch.nn.Module) -> None:
    """Declare the weights whole again (a complete reload by another path succeeded)."""
    setattr(model, UNDEFINED_ATTR, None)


def begin_direct_reload(model: torch.nn.Module) -> ReloadPlan:
    """Point every parameter at its write target; refuse by name if any cannot be resolved.

    Nothing has been written when this raises. Call :func:`finish_direct_reload` afterwards,
    whether loading succeeded or not.
    """
    if getattr(model, SESSION_ATTR, None) is not None:
        raise DirectReloadError("a direct reload is already in progress on this model")
    was_undefined = undefined_reason(model)
    plan = plan_direct_reload(model)
    if plan.problems:
        raise DirectReloadError(
            "not directly reloadable (nothing was written)"
            + (f"; the model is still undefined: {was_undefined}" if was_undefined else ""),
            plan.problems,
        )
    addresses = _addresses(model)
    live = {name: t for name, t, _ in live_tensors(model)}
    saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, target in plan.targets.items():
        tensor = live[name]
        if id(tensor) not in saved:
            saved[id(tensor)] = (tensor, tensor.data)
            tensor.data = target.view
    setattr(
        model, SESSION_ATTR, _Session(plan, saved, addresses, time.perf_counter(), was_undefined)
    )
    return plan


def finish_direct_reload(model: torch.nn.Module, complete: bool = True) -> ReloadReport:
    """Restore the live views and audit that no address, shape, stride or dtype changed.

    ``complete`` says whether every checkpoint tensor was written; only then is an earlier
    undefined state cleared. An audit failure marks the model undefined and raises.
    """
    session: _Session | None = getattr(model, SESSION_ATTR, None)
    if session is None:
        raise DirectReloadError("finish_direct_reload called without begin_direct_reload")
    for tensor, original in session.saved.values():
        tensor.data = original
    setattr(model, SESSION_ATTR, None)
    after = _addresses(model)
    changed = {
        name: f"address/layout changed during reload: {before} -> {after.get(name)}"
        for name, before in session.addresses.items()
        if after.get(name) != before
    }
    if changed:
        mark_undefined(model, "a reload changed parameter addresses")
        raise DirectReloadError("audit failed: the reload moved storages", changed)
    report = ReloadReport(
        relocations=session.plan.relocations,
        write_s=time.perf_counter() - session.started,
        recovered_from_undefined=session.was_undefined if complete else None,
    )
    if complete:
        clear_undefined(model)
    return report


def _convertible(src: torch.dtype, dst: torch.dtype) -> bool:
    """Casts allowed on reload: any float to any float (e.g. fp32 trainer -> bf16 engine)."""
    if src == dst:
        return True
    return src.is_floating_point and dst.is_floating_point


def preflight(layout: CheckpointLayout, specs: Mapping[str, TensorSpec]) -> dict[str, str]:
    """Problems of a checkpoint (name -> shape, dtype) against the recorded one; empty if fits."""
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
    for name in expected:
        if name in specs or name in layout.optional:
            continue
        if any(alias in specs for alias in aliases.get(name, ())):
            continue  # a tied name: its twin carries the bytes
        problems[name] = "missing from the checkpoint"
    return problems


def check_finite(
    weights: Iterable[tuple[str, torch.Tensor]],
    targets: Mapping[str, torch.dtype] | None = None,
) -> dict[str, str]:
    """Names of floating tensors holding NaN or Inf, or values the engine's dtype cannot hold.

    A sum in the tensor's own dtype is one vectorised pass with no allocation (NaN and Inf
    propagate through it; it runs at memory bandwidth, where a float64 sum or ``isfinite`` is
    5-20x slower); only a non-finite sum (NaN/Inf, or an overflow of a large half-precision
    tensor) pays for the exact element-wise check. ``targets`` (name -> the dtype the tensor is
    written into) adds a range check where the cast narrows, e.g. float64 -> float32, since a
    finite value beyond the target's range would become Inf in the engine.
    """
    bad: dict[str, str] = {}
    for name, t in weights:
        if not t.is_floating_point() or t.numel() == 0:
            continue
        if t.element_size() == 1:
            t = t.float()  # float8 kernels lack sum/isinf; one byte per element is cheap to widen
        if not torch.isfinite(t.sum()):
            nan = int(torch.isnan(t).sum())
            inf = int(torch.isinf(t).sum())
            if nan or inf:
                bad[name] = f"holds {nan} NaN and {inf} Inf values"
                continue
        target = (targets or {}).get(name)
        if target is not None and target.is_floating_point:
            limit = torch.finfo(target).max
            if torch.finfo(t.dtype).max > limit and float(t.abs().max()) > limit:
                bad[name] = f"holds values beyond the range of {target} (would become Inf)"
    return bad


def validate_checkpoint(
    layout: CheckpointLayout, items: list[tuple[str, torch.Tensor]], finite: bool = True
) -> None:
    """Refuse a whole checkpoint that does not fit ``layout``, before anything is written.

    Names, shapes and dtypes against the checkpoint recorded at load, then (``finite``) NaN/Inf
    and out-of-range values. Every reload path (direct or an engine's own) calls this first.
    """
    specs: dict[str, TensorSpec] = {}
    problems: dict[str, str] = {}
    for name, t in items:
        if name in specs:
            problems[name] = "appears twice in the checkpoint"
        specs[name] = TensorSpec(tuple(t.shape), t.dtype)
    problems.update(preflight(layout, specs))
    if finite and not problems:
        targets = {name: spec.dtype for name, spec in layout.checkpoint.items()}
        problems.update(check_finite(items, targets))
    if problems:
        raise DirectReloadError("checkpoint rejected (nothing was written)", problems)


def _copy_by_name(plan: ReloadPlan) -> Callable[[Iterable[tuple[str, torch.Tensor]]], None]:
    def load(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in weights:
            plan.targets[name].view.copy_(t)

    return load


def direct_reload(
    model: torch.nn.Module,
    weights: Weights,
    load: Callable[[Iterable[tuple[str, torch.Tensor]]], object] | None = None,
    finite: bool = True,
) -> ReloadReport:
    """Write ``weights`` into ``model``'s live storages: preflight, begin, load, finish.

    ``load`` receives an iterable of ``(name, tensor)``; by default the model's own
    ``load_weights`` if it has one, else a copy by name. The whole checkpoint is checked against
    the recorded layout (names, shapes, dtypes, and NaN/Inf when ``finite``) before the first
    write; a failure after writing started marks the model undefined and raises.
    """
    started = time.perf_counter()
    layout = _require_layout(model)
    items = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
    validate_checkpoint(layout, items, finite)
    preflight_s = time.perf_counter() - started

    plan = begin_direct_reload(model)
    if load is None:
        own = getattr(model, "load_weights", None)
        load = own if callable(own) else _copy_by_name(plan)
    try:
        load(iter(items))
    except BaseException as exc:
        reason = f"direct reload failed after writing started: {type(exc).__name__}: {exc}"
        mark_undefined(model, reason)
        finish_direct_reload(model, complete=False)
        raise DirectReloadError(reason) from exc
    report = finish_direct_reload(model, complete=True)
    report.tensors = len(items)
    report.bytes = sum(t.numel() * t.element_size() for _, t in items)
    report.preflight_s = preflight_s
    report.elapsed_s = time.perf_counter() - started
    return report
