"""Pushes into vLLM's online FP8 linears: the new floats quantized again, in place.

vLLM quantizes each such linear once, at load (site 23): the float ``weight`` (N, K) becomes FP8
bytes stored transposed (K, N) and a ``weight_scale`` computed from the whole fused tensor (one
per tensor, or one per output channel). A float written into those bytes is not what a cold
start computes with, so a push re-runs the same quantization instead:

* **The method's own code, never a copy of its formulas.** The live method's
  ``process_weights_after_loading`` runs on a scratch module holding the new floats (the
  layer's attributes, its ``quant_method``), so the amax, the rounding (a reciprocal or a true
  division) and the clamp are vLLM's, whatever version runs.
* **Proven at load.** As vLLM quantizes a layer at load, the float weight it starts from is
  kept for a moment and quantized again on a scratch module: only a layer whose bytes and scale
  come out bit for bit equal to the live ones (and whose kernel computes with them as they are:
  same shape, stride and dtype) is written by a push; any other is refused by name.
* **The model's own loader fills the floats.** A bf16 staging tensor (N, K), allocated for one
  module at a time and freed once that module is written, takes the place of the FP8 weight
  while the model's ``load_weights`` loads the module's checkpoint tensors: the q/k/v and
  gate/up shards land where, and cast as, they do at a cold start. It starts as NaN, so an
  element the loader left out is seen, not quantized.
* **The whole fused tensor, finite.** A per-tensor scale is the amax of every shard, so a push
  touching a fused module carries all of its shards (else refused by name, nothing written),
  and NaN/Inf in any of them (which poisons the amax) is refused before the first byte,
  whatever the engine's ``check_finite``.
* **In place, read back, undone.** The bytes and scale are copied into the live storages
  (addresses unchanged: what CUDA graphs captured), compared bit for bit with what the method
  computed, and their pre-images (one byte per weight, in host memory) restore them exactly if
  anything of the push fails.

One rank only (a per-tensor scale across tensor-parallel ranks is the MAX of every rank's amax,
not computed here): an engine with ``tp_size > 1`` is refused by name.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary

import torch

from ...direct import DirectReloadError
from ...direct.report import ReloadReport
from ...direct.state import bridge_state, note_written
from ...direct.undo import UndoLog
from ...direct.validate import find_nonfinite
from ...layout import CheckpointLayout
from ..internals.model import (
    fp8_scratch,
    fused_shards,
    loader_dims,
    quantized_layers,
    restore_loader_dims,
)
from ..options import bridge_options

KIND = "fp8 re-quantize"
WRITING = "an FP8 re-quantizing write started and did not finish"

Process = Callable[[Any, torch.nn.Module], None]


@dataclass
class Fp8Layer:
    """What a push needs of one online FP8 linear: the method's own processing (``process``,
    the unpatched one), the float dtype its loader writes, and why it is not writable (None:
    proven at load)."""

    process: Process
    dtype: torch.dtype
    unproven: str | None = None


_layers: WeakKeyDictionary[torch.nn.Module, Fp8Layer] = WeakKeyDictionary()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers (FP8 bytes, float32 scales): NaN compares, -0 differs from 0."""
    return t.detach().view(torch.uint8) if t.element_size() == 1 else t.detach().view(torch.int32)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


@torch.no_grad()
def quantize(
    process: Process, layer: torch.nn.Module, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (N, K, the float dtype) quantized by ``layer``'s own method on a scratch
    module: the FP8 weight (K, N) and its scale, as vLLM leaves them on the layer."""
    scratch = fp8_scratch(layer, weight)
    process(layer.quant_method, scratch)
    return scratch.get_parameter("weight").detach(), scratch.get_parameter("weight_scale").detach()


def _mismatch(layer: torch.nn.Module, q: torch.Tensor, scale: torch.Tensor) -> str | None:
    """Why ``q`` and ``scale`` cannot be copied into the layer's live ones (None: they can)."""
    for name, fresh in (("weight", q), ("weight_scale", scale)):
        live = getattr(layer, name)
        if (live.shape, live.stride(), live.dtype) != (fresh.shape, fresh.stride(), fresh.dtype):
            return (
                f"its kernel holds {name} as {list(live.shape)} {live.dtype} stride "
                f"{live.stride()}, the method yields {list(fresh.shape)} {fresh.dtype} stride "
                f"{fresh.stride()} (repacked: not written in place)"
            )
    return None


def process_online_fp8(original: Process) -> Process:
    """The online FP8 linear methods' processing (site 23): in a bridged engine, the layer's
    float weight is kept while vLLM quantizes it, quantized again on a scratch module and
    compared bit for bit with what the layer holds now (the proof a push relies on)."""

    @torch.no_grad()
    def process_weights_after_loading(self: Any, layer: torch.nn.Module) -> None:
        weight = getattr(layer, "weight", None)
        done = getattr(layer, "_already_called_process_weights_after_loading", False)
        if bridge_options() is None or done or weight is None or weight.is_meta:
            return original(self, layer)
        kept = weight.detach().clone()
        dims = loader_dims(weight)
        original(self, layer)
        restore_loader_dims(layer.get_parameter("weight"), dims)
        record = _layers[layer] = Fp8Layer(original, kept.dtype)
        if int(getattr(layer, "tp_size", 1)) != 1:
            record.unproven = "tensor-parallel FP8 (the scale spans every rank) is not written"
            return
        q, scale = quantize(original, layer, kept)
        record.unproven = _mismatch(layer, q, scale)
        if record.unproven is None and not (
            _same_bits(q, layer.get_parameter("weight"))
            and _same_bits(scale, layer.get_parameter("weight_scale"))
        ):
            record.unproven = "quantizing its float weight again does not give its bytes and scale"

    return process_weights_after_loading


def _refusals(model: torch.nn.Module, layout: CheckpointLayout) -> dict[str, str]:
    """The quantized layers a push cannot write, by name -> why."""
    problems = {}
    layers = dict(model.named_modules())
    for name, method in quantized_layers(model).items():
        record = _layers.get(layers[name])
        if record is None:
            problems[name] = f"held quantized ({method}): no re-quantizing writer for it"
        elif record.unproven is not None:
            problems[name] = f"held quantized ({method}): {record.unproven}"
        elif any(s not in layout.checkpoint for s in fused_shards(model, name)):
            problems[name] = f"held quantized ({method}): its checkpoint shards are not known"
    return problems


def split_quantized(
    model: torch.nn.Module,
    layout: CheckpointLayout,
    items: list[tuple[str, torch.Tensor]],
) -> tuple[dict[str, list[tuple[str, torch.Tensor]]], list[tuple[str, torch.Tensor]]]:
    """``items`` split into what feeds each quantized module (module -> its shards, whole)
    and the rest. Refused by name, nothing written: a quantized layer no push can write, a
    fused module missing a shard, NaN/Inf or out-of-range values in anything quantized."""
    problems = _refusals(model, layout)
    if problems:
        raise DirectReloadError(
            "the engine holds quantized layers a push cannot re-quantize (nothing was written)",
            problems,
        )
    owner = {s: m for m in quantized_layers(model) for s in fused_shards(model, m)}
    feeds: dict[str, list[tuple[str, torch.Tensor]]] = {}
    rest = []
    for name, t in items:
        if name in owner:
            feeds.setdefault(owner[name], []).append((name, t))
        else:
            rest.append((name, t))
    for module, got in feeds.items():
        missing = sorted(set(fused_shards(model, module)) - {n for n, _ in got})
        if missing:
            problems[module] = (
                f"the push lacks {', '.join(missing)}: the FP8 scale is computed from every "
                "shard of the fused weight"
            )
    if problems:
        raise DirectReloadError(
            "a partial push splits a quantized module (nothing was written)", problems
        )
    targets = {name: layout.checkpoint[name].dtype for name in owner}
    bad = find_nonfinite([i for got in feeds.values() for i in got], targets)
    if bad:
        raise DirectReloadError(
            "checkpoint rejected: a quantized module's scale would not be finite (nothing was "
            "written)",
            bad,
        )
    return feeds, rest


def _no_loader(_: Iterable[tuple[str, torch.Tensor]]) -> None:
    raise DirectReloadError("the model has no load_weights: its loader is what fills the floats")


class Fp8Requant:
    """The writer of the quantized modules of a push (:class:`~weight_bridge.direct.writer
    .Writer`): each module's shards loaded into a float staging tensor by the model's own
    loader, quantized by its method, copied into its live bytes and scale, read back; the
    pre-images of every byte and scale written are its undo log."""

    mode = "direct"

    def __init__(self, model: torch.nn.Module, feeds: Mapping[str, list[tuple[str, torch.Tensor]]]):
        self.model, self.feeds = model, dict(feeds)
        self.load: Callable[[Iterable[tuple[str, torch.Tensor]]], object] = (
            getattr(model, "load_weights", None) or _no_loader
        )
        self.undo_log: UndoLog | None = None

    def run(self) -> ReloadReport:
        started = time.perf_counter()
        layers = {name: self.model.get_submodule(name) for name in self.feeds}
        views = [getattr(m, p) for m in layers.values() for p in ("weight", "weight_scale")]
        log = UndoLog.pre_images(self.model, views, {})
        state = bridge_state(self.model)
        before = state.undefined
        state.undefined = before or WRITING
        name = ""
        try:
            for name, layer in layers.items():
                self._write(layer, self.feeds[name])
        except Exception as exc:
            error = DirectReloadError(
                f"re-quantizing {name} failed: {type(exc).__name__}: {exc}",
                {name: f"{type(exc).__name__}: {exc}"},
            )
            raise log.restore_after(self.model, error, before) from exc
        finally:
            note_written(self.model)
        state.undefined = before
        self.undo_log = log
        items = [t for got in self.feeds.values() for _, t in got]
        report = ReloadReport(tensors=len(items), direct=len(items))
        report.bytes = sum(t.numel() * t.element_size() for t in items)
        report.refreshed = dict.fromkeys(layers, KIND)
        report.verified_writes = 2 * len(layers)
        report.elapsed_s = report.write_s = time.perf_counter() - started
        return report

    @torch.no_grad()
    def _write(self, layer: torch.nn.Module, items: list[tuple[str, torch.Tensor]]) -> None:
        record = _layers[layer]
        live, live_scale = layer.get_parameter("weight"), layer.get_parameter("weight_scale")
        rows, cols = live.shape[1], live.shape[0]  # live is (K, N): the staging is (N, K)
        staging = torch.full((rows, cols), float("nan"), dtype=record.dtype, device=live.device)
        held = live.data
        live.data = staging
        try:
            self.load(iter(items))
        finally:
            live.data = held
        if staging.isnan().any():
            raise RuntimeError("the float weight holds NaN after the load (left unwritten?)")
        q, scale = quantize(record.process, layer, staging)
        del staging
        why = _mismatch(layer, q, scale)
        if why is None and not (torch.isfinite(scale).all() and (scale > 0).all()):
            why = "the method computed a scale that is not finite and positive (an all-zero weight)"
        if why is None and ((_bits(q) & 0x7F) == 0x7F).any():
            why = "the method computed NaN bytes"
        if why is not None:
            raise RuntimeError(why)
        live.copy_(q)
        live_scale.copy_(scale)
        if not (_same_bits(live, q) and _same_bits(live_scale, scale)):
            raise RuntimeError("read-back: the live FP8 bytes or scale differ from those computed")
