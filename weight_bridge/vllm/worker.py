"""Worker extension: the bridge's methods inside every vLLM worker process.

vLLM mixes this class into its worker (``worker_extension_cls``); the engine calls the methods
through ``collective_rpc``, so each worker (each tensor-parallel rank) opens the checkpoint
itself, memory-mapped, and its own weight loaders keep only its shard. Only small plain values
cross the process boundary: paths in, :class:`~.results.PushResult` dicts out. Expected
refusals and failures are results, not exceptions, so they reach the caller typed and without
a traceback in the log.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch

from ..checkpoint import CheckpointError, CheckpointReader
from ..direct import (
    DirectReloadError,
    ReloadReport,
    clear_undefined,
    direct_reload,
    mark_undefined,
    plan_direct_reload,
    undefined_reason,
    validate_checkpoint,
)
from ..direct.plan import require_layout
from ..direct.proof import module_of
from ..direct.session import refresh_derived_state
from ..layout import live_tensors
from ..state import bridge_state
from .layerwise import LayerwiseReprocessor
from .plugin import bridge_options, torch_linear
from .refresh import CpuLinearRepack, CpuMoePrepack
from .results import PushError, PushResult

__all__ = ["WeightBridgeWorkerExtension"]


class WeightBridgeWorkerExtension:
    """Methods vLLM adds to its worker; ``self`` is the worker."""

    model_runner: Any
    vllm_config: Any

    def _bridge_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()

    def _reset_runner_caches(self) -> None:
        for name in ("reset_encoder_cache", "reset_mm_cache"):
            reset = getattr(self.model_runner, name, None)
            if callable(reset):
                reset()

    def weight_bridge_push(
        self,
        checkpoint: str,
        finite: bool = True,
        verify_hash: bool = False,
        mode: str = "direct",
        readback: str = "sampled",
        partial: bool = False,
    ) -> dict:
        """Reload ``checkpoint`` into this worker's model (``mode``: direct, auto, layerwise);
        ``partial``: a subset of tensors written on top of what the model holds."""
        model = self._bridge_model()
        result = PushResult(rank=int(getattr(self, "rank", 0)), mode=mode)
        before = undefined_reason(model)
        try:
            with CheckpointReader(checkpoint) as reader:
                if verify_hash:
                    reader.verify_hash()
                items = list(reader.tensors())
                report = self._reload(model, items, finite, mode, readback, partial, result)
            try:
                self._reset_runner_caches()
            except Exception as exc:
                mark_undefined(model, f"runner cache reset failed after a push: {exc}")
                raise DirectReloadError(str(undefined_reason(model))) from exc
            result.report = report
        except DirectReloadError as exc:
            after = undefined_reason(model)
            phase = "after-write" if after is not None and after != before else "refused"
            result.error = PushError("DirectReloadError", exc.summary, exc.problems, phase)
        except CheckpointError as exc:
            problems = {exc.tensor: exc.problem} if exc.tensor else {}
            result.error = PushError("CheckpointError", str(exc), problems)
        result.undefined = undefined_reason(model)
        return result.to_dict()

    def _reload(
        self,
        model: torch.nn.Module,
        items: list,
        finite: bool,
        mode: str,
        readback: str,
        partial: bool,
        result: PushResult,
    ) -> ReloadReport:
        if mode == "direct":
            return direct_reload(model, items, finite=finite, readback=readback, partial=partial)
        if mode != "layerwise":
            reprocessable = _auto_reprocessable(model)
            plan = plan_direct_reload(model, reprocessable)
            if plan.targets or plan.problems:
                result.mode = "hybrid" if plan.reprocess else "direct"
                return direct_reload(
                    model,
                    items,
                    finite=finite,
                    reprocessor=LayerwiseReprocessor(model, self.vllm_config.model_config),
                    reprocessable=reprocessable,
                    readback=readback,
                    partial=partial,
                )
        if partial:
            raise DirectReloadError(
                "a partial checkpoint is written directly; vLLM's layerwise reload needs whole "
                "layers: push a complete checkpoint (nothing was written)"
            )
        result.mode = "layerwise"  # asked for, or nothing at all can be written directly
        return self._layerwise(model, items, finite)

    def _layerwise(self, model: torch.nn.Module, items: list, finite: bool) -> ReloadReport:
        """vLLM's own whole-model ``reload_weights``, behind the same checks as a direct push."""
        layout = require_layout(model)
        wrong = _layerwise_wrong(model)
        if wrong:
            raise DirectReloadError(
                "vLLM's layerwise reload is wrong for this engine (nothing was written)", wrong
            )
        validate_checkpoint(layout, items, finite)
        mark_undefined(model, "a layerwise reload started writing and did not finish")
        try:
            self.reload_weights(weights_iterator=iter(items), is_checkpoint_format=True)  # type: ignore[attr-defined]
        except Exception as exc:
            mark_undefined(model, f"layerwise reload failed: {type(exc).__name__}: {exc}")
            raise DirectReloadError(str(undefined_reason(model))) from exc
        report = ReloadReport(
            tensors=len(items),
            bytes=sum(t.numel() * t.element_size() for _, t in items),
            refreshed=refresh_derived_state(model, bridge_state(model).refreshers),
            reprocessed={"<all>": "whole-model layerwise reload"},
        )
        clear_undefined(model)
        return report

    def weight_bridge_plan(self, mode: str = "direct") -> dict:
        """A dry run: per name, its write target, refresh, re-processing or refusal."""
        model = self._bridge_model()
        state = bridge_state(model)
        if state.layout is None:
            return {"error": "no checkpoint layout recorded: was the engine bridged?"}
        reprocessable = _auto_reprocessable(model) if mode == "auto" else set()
        plan = plan_direct_reload(model, reprocessable)
        relocated = {r.name: asdict(r) for r in plan.relocations}
        proof = state.proof
        return {
            "targets": {
                name: {
                    "shape": list(t.view.shape),
                    "relocation": relocated.get(name),
                    "refresh": plan.refresh.get(module_of(name)[0]),
                }
                for name, t in plan.targets.items()
            },
            "problems": dict(plan.problems),
            "reprocess": dict(plan.reprocess),
            "transformed": dict(proof.transformed) if proof else {},
            "derived": dict(proof.derived) if proof else {},
            "noted": dict(proof.noted) if proof else {},
            "options": bridge_options(self.vllm_config),
        }

    def weight_bridge_addresses(self) -> dict[str, tuple]:
        """Every parameter/buffer name -> (data_ptr, shape, stride, dtype)."""
        return {
            name: (t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.dtype))
            for name, t, _ in live_tensors(self._bridge_model())
        }

    def weight_bridge_undefined(self) -> str | None:
        """Why this worker's weights are half-written, or None."""
        return undefined_reason(self._bridge_model())


def _shared_parameter_modules(model: torch.nn.Module) -> set[str]:
    """Modules holding a parameter that another module holds too (tied weights)."""
    owners: dict[int, list[str]] = {}
    for module_name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(module_name)
    return {m for names in owners.values() if len(names) > 1 for m in names}


def _auto_reprocessable(model: torch.nn.Module) -> set[str]:
    """Modules ``auto`` may hand to vLLM's per-layer processing.

    vLLM's layerwise reload processes a tied parameter for one of its modules only (its
    Limitation 2), so modules with tied parameters are never handed to it.
    """
    return bridge_state(model).reprocessable - _shared_parameter_modules(model)


def _layerwise_wrong(model: torch.nn.Module) -> dict[str, str]:
    """Weights vLLM's whole-model layerwise reload leaves wrong on this engine (measured)."""
    refreshers = bridge_state(model).refreshers
    tied = _shared_parameter_modules(model)
    wrong = {}
    for name, module in model.named_modules():
        refresher = refreshers.get(name)
        if isinstance(refresher, CpuMoePrepack):
            wrong[f"{name}.w13_weight"] = (
                "CPU MoE experts: a layerwise update skips the kernel's prepack"
            )
        linear = getattr(module, "cpu_linear", None)
        packed = linear is not None and linear is not torch_linear
        if packed and name in tied and not isinstance(refresher, CpuLinearRepack):
            wrong[f"{name}.weight"] = (
                "tied weight feeding a packed CPU linear whose copy layerwise processing does "
                "not re-derive (start the engine with cpu_linear='torch' or 'repack')"
            )
    return wrong
