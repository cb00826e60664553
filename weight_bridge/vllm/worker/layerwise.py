"""vLLM's layerwise reload, restricted to the modules a direct write cannot serve.

A push in ``auto`` mode writes every proven weight directly and hands only the modules whose
state post-load processing transformed or derived (and that vLLM's own per-layer processing
re-creates: a quantization method's or an attention layer's) to vLLM's layerwise machinery:
those layers are put back on the meta device, their weights are buffered as ``load_weights``
streams them, re-processed, and copied into the original storages (addresses unchanged). It
runs in the same ``load_weights`` pass as the direct writes.

The vLLM internals of ``vllm.model_executor.model_loader.reload`` it relies on are driven by
:mod:`~weight_bridge.vllm.internals` (:func:`~weight_bridge.vllm.internals.model.layerwise_begin`,
:func:`~weight_bridge.vllm.internals.model.layerwise_finish`); the per-layer metadata they use is
recorded by vLLM at model init (``record_metadata_for_reloading``). Which modules ``auto`` may
hand to it (:func:`auto_reprocessable`) and what a whole-model layerwise reload would leave wrong
(:func:`layerwise_wrong`) feed the push's plan (:func:`.writers.push_plan`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...direct import DirectReloadError, ReloadReport
from ...direct.session import refresh_derived_state
from ...direct.state import bridge_state, clear_undefined, mark_undefined, undefined_reason
from ...direct.undo import UndoLog
from ..internals.model import layerwise_begin, layerwise_finish
from ..internals.patches import cpu_linear_of
from .refresh import CpuLinearRepack, CpuMoePrepack, torch_linear


class LayerwiseReprocessor:
    """:class:`~weight_bridge.direct.Reprocessor` over vLLM's layerwise reload internals."""

    def __init__(self, model: torch.nn.Module, model_config: Any):
        self.model = model
        self.model_config = model_config
        self.modules: list[str] = []

    @torch.no_grad()
    def begin(self, modules: list[str]) -> None:
        self.modules = modules
        layerwise_begin(self.model, modules)

    @torch.no_grad()
    def finish(self) -> None:
        layerwise_finish(self.model, self.model_config)


class LayerwiseWrite:
    """vLLM's own whole-model reload, behind the same checks as a direct one (the checkpoint
    validated when it was prepared): a :class:`~weight_bridge.direct.writer.Writer` without
    pre-images. ``reload``: the worker's ``reload_weights``."""

    mode = "layerwise"

    def __init__(self, model: torch.nn.Module, items: list, reload: Callable[..., None]) -> None:
        self.model, self.items, self.reload = model, items, reload
        self.undo_log: UndoLog | None = None

    def run(self) -> ReloadReport:
        model = self.model
        mark_undefined(model, "a layerwise reload started writing and did not finish")
        try:
            self.reload(weights_iterator=iter(self.items), is_checkpoint_format=True)
        except Exception as exc:
            mark_undefined(model, f"layerwise reload failed: {type(exc).__name__}: {exc}")
            raise DirectReloadError(str(undefined_reason(model))) from exc
        report = ReloadReport(
            tensors=len(self.items),
            bytes=sum(t.numel() * t.element_size() for _, t in self.items),
            refreshed=refresh_derived_state(model, bridge_state(model).refreshers),
            reprocessed={"<all>": "whole-model layerwise reload"},
        )
        clear_undefined(model)
        return report


def _shared_parameter_modules(model: torch.nn.Module) -> set[str]:
    """Modules holding a parameter that another module holds too (tied weights)."""
    owners: dict[int, list[str]] = {}
    for module_name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(module_name)
    return {m for names in owners.values() if len(names) > 1 for m in names}


def auto_reprocessable(model: torch.nn.Module) -> set[str]:
    """Modules ``auto`` may hand to vLLM's per-layer processing.

    vLLM's layerwise reload processes a tied parameter for one of its modules only (its
    Limitation 2), so modules with tied parameters are never handed to it.
    """
    return bridge_state(model).reprocessable - _shared_parameter_modules(model)


def layerwise_wrong(model: torch.nn.Module) -> dict[str, str]:
    """Weights vLLM's whole-model layerwise reload would leave wrong on this engine, with why."""
    refreshers = bridge_state(model).refreshers
    tied = _shared_parameter_modules(model)
    wrong = {}
    for name, module in model.named_modules():
        refresher = refreshers.get(name)
        if isinstance(refresher, CpuMoePrepack):
            wrong[f"{name}.w13_weight"] = (
                "CPU MoE experts: a layerwise update skips the kernel's prepack"
            )
        linear = cpu_linear_of(module)
        packed = linear is not None and linear is not torch_linear
        if packed and name in tied and not isinstance(refresher, CpuLinearRepack):
            wrong[f"{name}.weight"] = (
                "tied weight feeding a packed CPU linear whose copy layerwise processing does "
                "not re-derive (start the engine with cpu_linear='torch' or 'repack')"
            )
    return wrong
