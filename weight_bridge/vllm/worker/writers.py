"""Which writer writes a push: one registry, by mode.

Every writer follows :class:`~weight_bridge.direct.writer.Writer` (prepared with nothing written,
run once, then taken back from its pre-images or from the files served before), so the
transaction (:mod:`.transaction`) holds one writer per push and knows nothing of how it writes.
What the mode decides is only which one is prepared:

* ``delta``: a delta checkpoint, whatever the engine's reload mode (its scatters, then a direct
  reload of what they cannot patch: :func:`~weight_bridge.direct.delta.prepare_delta`);
* ``direct`` and ``auto``: the bridge's direct reload (``auto`` hands the modules vLLM's
  per-layer processing re-creates to it: :class:`.layerwise.LayerwiseReprocessor`);
* ``vllm-direct``: vLLM's own direct reload, 0.34+ (:class:`.vllm_direct.VllmDirectWrite`);
* ``layerwise``: vLLM's whole-model reload (:class:`.layerwise.LayerwiseWrite`).

Which of the last four a complete or partial push takes is :func:`push_plan`'s one decision,
shared with the dry run (:mod:`.queries`): the plan beside the registry it picks from.

An engine holding quantized layers is written one way, in ``direct`` and ``auto``: its online
FP8 linears re-quantized in place (:class:`.fp8_requant.Fp8Requant`), then the rest as a direct
partial write; a delta, another mode, or a layer that cannot be proven is refused by name
(:func:`_quantized`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ...delta.format import is_delta
from ...direct import DirectReloadError, ReloadPlan, plan_direct_reload, prepare_direct_reload
from ...direct.record import require_layout
from ...direct.undo import HostStore
from ...direct.validate import validate_checkpoint
from ...direct.writer import Writer, Writers
from ..internals.model import quantized_layers
from ..internals.vllm_direct import vllm_direct_refusal
from ..options import BridgeOptions
from .adapter_writer import MODE as ADAPTER
from .adapter_writer import AdapterWrite, is_adapter_job
from .delta_links import plan_delta
from .fp8_requant import Fp8Requant, split_quantized
from .layerwise import LayerwiseReprocessor, LayerwiseWrite, auto_reprocessable, layerwise_wrong
from .vllm_direct import VllmDirectWrite


@dataclass(frozen=True)
class WriteJob:
    """What a writer is prepared from: the worker's model, the checkpoint's tensors and
    header, and how to write them (``reload``: the worker's ``reload_weights``, vLLM's
    layerwise reload)."""

    model: torch.nn.Module
    model_config: Any
    options: BridgeOptions
    path: str
    metadata: Mapping[str, str]
    items: list[tuple[str, torch.Tensor]]
    finite: bool
    partial: bool
    reload: Callable[..., None]
    # keep what every write replaces (a rollback re-reads no file): in this host store
    pre_images: HostStore | None = None
    # tensors produced one at a time as the write asks (a push from memory: ``items`` are
    # their descriptions, :class:`~weight_bridge.checkpoint.live.LiveTensor`)
    stream: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None


@dataclass
class PushPlan:
    """How a complete push in a reload mode writes: ``mode`` (``direct``, ``auto`` or
    ``layerwise``: what the report will say), ``plan`` (the direct writes, re-processing and
    refusals; None for vLLM's whole-model layerwise reload), ``reprocessable`` (the modules
    vLLM's per-layer processing may take; None: no re-processing asked) and ``wrong`` (the
    weights whole-model layerwise would leave wrong: a layerwise push is refused naming them)."""

    mode: str
    plan: ReloadPlan | None
    reprocessable: set[str] | None = None
    wrong: dict[str, str] | None = None


def push_plan(model: torch.nn.Module, mode: str) -> PushPlan:
    """The one plan of a push in ``mode``, for the push itself and for its dry run: ``direct``
    writes what is proven; ``auto`` does the same and re-processes what vLLM's per-layer
    processing re-creates, and falls back to whole-model layerwise only when nothing at all
    can be written directly; ``layerwise`` is vLLM's whole-model reload (no direct targets);
    ``vllm-direct`` is vLLM's own direct reload (0.34+), ``wrong`` holding what it refuses."""
    if mode == "vllm-direct":
        refusal = vllm_direct_refusal(model)
        return PushPlan("vllm-direct", None, wrong={"<vllm-direct>": refusal} if refusal else {})
    if mode == "direct":
        return PushPlan("direct", plan_direct_reload(model))
    if mode == "auto":
        reprocessable = auto_reprocessable(model)
        plan = plan_direct_reload(model, reprocessable)
        if plan.targets or plan.problems:  # else nothing at all can be written directly
            return PushPlan("auto" if plan.reprocess else "direct", plan, reprocessable)
    return PushPlan("layerwise", None, wrong=layerwise_wrong(model))


def _delta(job: WriteJob, _: PushPlan | None) -> Writer:
    return plan_delta(job.model, job.options, job.path, job.metadata, job.items, job.finite)


def _direct(job: WriteJob, chosen: PushPlan | None) -> Writer:
    assert chosen is not None
    reprocessable = chosen.reprocessable
    return prepare_direct_reload(
        job.model,
        job.items,
        check_finite=job.finite,
        reprocessor=(
            LayerwiseReprocessor(job.model, job.model_config) if reprocessable is not None else None
        ),
        reprocessable=reprocessable or frozenset(),
        readback=job.options.readback,
        partial=job.partial,
        pre_images=job.pre_images or False,
        stream=job.stream,
    )


def _vllm_direct(job: WriteJob, chosen: PushPlan | None) -> Writer:
    assert chosen is not None
    return VllmDirectWrite.prepare(
        job.model,
        job.model_config,
        job.items,
        finite=job.finite,
        partial=job.partial,
        refusal=(chosen.wrong or {}).get("<vllm-direct>"),
        readback=job.options.readback,
    )


def _layerwise(job: WriteJob, chosen: PushPlan | None) -> Writer:
    assert chosen is not None
    if job.partial:
        raise DirectReloadError(
            "a partial checkpoint is written directly; vLLM's layerwise reload needs whole "
            "layers: push a complete checkpoint (nothing was written)"
        )
    if chosen.wrong:
        raise DirectReloadError(
            "vLLM's layerwise reload is wrong for this engine (nothing was written)",
            chosen.wrong,
        )
    validate_checkpoint(require_layout(job.model), job.items, job.finite)
    return LayerwiseWrite(job.model, job.items, job.reload)


def _adapter(job: WriteJob, _: PushPlan | None) -> Writer:
    if job.stream is not None:
        raise DirectReloadError("an adapter is pushed as a PEFT directory (nothing was written)")
    return AdapterWrite.prepare(job.model, job.path, job.metadata, job.items, job.finite)


# mode -> how that mode's writer is prepared (a refusal raises, nothing written)
WRITERS: dict[str, Callable[[WriteJob, PushPlan | None], Writer]] = {
    ADAPTER: _adapter,
    "delta": _delta,
    "direct": _direct,
    "auto": _direct,
    "vllm-direct": _vllm_direct,
    "layerwise": _layerwise,
}


def _quantized(job: WriteJob, mode: str) -> Writer | None:
    """The writer of a push of base weights into an engine that holds quantized layers (None:
    it holds none). vLLM's online FP8 linears are re-quantized in place (:mod:`.fp8_requant`,
    first, with pre-images), the rest written directly as a partial push; anything else is
    refused by name before anything is written: a quantized layer no push can prove, a delta
    (its changes are of floats the engine no longer holds), tensors pushed from memory, and
    vLLM's own reloads, which are not proven against a cold start of a quantized engine."""
    if not quantized_layers(job.model):
        return None
    why = None
    if is_delta(job.metadata):
        why = "a delta is never applied to quantized bytes: push a complete checkpoint"
    elif job.stream is not None:
        why = "tensors pushed from memory are not re-quantized yet: push a checkpoint file"
    elif mode not in ("direct", "auto"):
        why = f"reload_mode {mode!r} is not proven on quantized layers: use 'direct' or 'auto'"
    if why is not None:
        raise DirectReloadError(f"{job.path}: {why} (nothing was written)", {job.path: why})
    layout = require_layout(job.model)
    validate_checkpoint(layout, job.items, False, job.partial)  # finiteness: each part's own
    feeds, rest = split_quantized(job.model, layout, job.items)
    parts: list[Writer] = [Fp8Requant(job.model, feeds)] if feeds else []
    if rest:
        parts.append(
            prepare_direct_reload(
                job.model,
                rest,
                check_finite=job.finite,
                readback=job.options.readback,
                partial=True,
            )
        )
    if not parts:
        raise DirectReloadError(f"{job.path}: the push holds no tensor (nothing was written)")
    return Writers(job.model, parts)


def prepare_writer(job: WriteJob, mode: str | None = None) -> Writer:
    """The writer of ``job`` in ``mode`` (default: the engine's reload mode); a delta is
    always the delta writer's, an adapter the adapter writer's. Nothing is written; a refusal
    raises naming each tensor."""
    if is_adapter_job(job.path, job.metadata):
        return WRITERS[ADAPTER](job, None)
    quantized = _quantized(job, mode or job.options.reload_mode)
    if quantized is not None:
        return quantized
    delta = is_delta(job.metadata)
    chosen = None if delta else push_plan(job.model, mode or job.options.reload_mode)
    writer = "delta" if chosen is None else chosen.mode
    if job.stream is not None and writer not in ("direct", "auto"):
        raise DirectReloadError(
            f"tensors pushed from memory are written by the direct writer, not {writer!r} "
            "(it reads whole checkpoints): nothing was written"
        )
    return WRITERS[writer](job, chosen)
