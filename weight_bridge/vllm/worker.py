"""Worker extension: the bridge's methods inside every vLLM worker process.

vLLM mixes this class into its worker (``worker_extension_cls``); the engine calls the methods
through ``collective_rpc``, so each worker (each tensor-parallel rank) opens the checkpoint
itself, memory-mapped, and its own weight loaders keep only its shard. Only small plain values
cross the process boundary: paths in, reports out.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch

from ..checkpoint import CheckpointReader
from ..direct import (
    DirectReloadError,
    clear_undefined,
    direct_reload,
    mark_undefined,
    plan_direct_reload,
    undefined_reason,
    validate_checkpoint,
)
from ..layout import get_checkpoint_layout, live_tensors
from .plugin import bridge_options, refresh_derived_state

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
        self, checkpoint: str, finite: bool = True, verify_hash: bool = False
    ) -> dict:
        """Direct reload of ``checkpoint`` into this worker's model; returns the report."""
        model = self._bridge_model()
        with CheckpointReader(checkpoint) as reader:
            if verify_hash:
                reader.verify_hash()
            report = direct_reload(model, reader.tensors(), finite=finite)
        refreshed = refresh_derived_state(model)
        self._reset_runner_caches()
        out = asdict(report)
        out["relocations"] = [asdict(r) for r in report.relocations]
        out["refreshed_layers"] = refreshed
        return out

    def weight_bridge_layerwise(
        self, checkpoint: str, finite: bool = True, verify_hash: bool = False
    ) -> dict:
        """vLLM's own layerwise ``reload_weights``, behind the same checks as a direct push."""
        model = self._bridge_model()
        layout = get_checkpoint_layout(model)
        if layout is None:
            raise DirectReloadError("no checkpoint layout recorded: was the engine bridged?")
        tied = _tied_packed_linears(model)
        if tied:
            raise DirectReloadError(
                "vLLM's layerwise reload is wrong here: a tied weight feeds a packed CPU linear "
                "that layerwise processing does not re-derive (start the engine with "
                "cpu_linear='torch' or 'repack')",
                {name: "tied weight with a stale packed copy" for name in tied},
            )
        with CheckpointReader(checkpoint) as reader:
            if verify_hash:
                reader.verify_hash()
            items = list(reader.tensors())
            validate_checkpoint(layout, items, finite)
            try:
                self.reload_weights(weights_iterator=iter(items), is_checkpoint_format=True)  # type: ignore[attr-defined]
            except BaseException as exc:
                mark_undefined(model, f"layerwise reload failed: {type(exc).__name__}: {exc}")
                raise
        clear_undefined(model)
        refresh_derived_state(model)
        return {"tensors": len(items), "bytes": sum(t.nbytes for _, t in items)}

    def weight_bridge_plan(self) -> dict:
        """A dry run of ``begin``: per name, the write target or why there is none."""
        model = self._bridge_model()
        if get_checkpoint_layout(model) is None:
            return {"error": "no checkpoint layout recorded: was the engine bridged?"}
        plan = plan_direct_reload(model)
        relocated = {r.name: asdict(r) for r in plan.relocations}
        return {
            "targets": {
                name: {"shape": list(t.view.shape), "relocation": relocated.get(name)}
                for name, t in plan.targets.items()
            },
            "problems": dict(plan.problems),
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


def _tied_packed_linears(model: torch.nn.Module) -> list[str]:
    """Tied parameters of modules whose CPU linear computes from a packed copy."""
    owners: dict[int, list[str]] = {}
    for module_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(f"{module_name}.{pname}")
    tied = {pid for pid, names in owners.items() if len(names) > 1}
    from .plugin import _torch_linear

    bad = []
    for module_name, module in model.named_modules():
        linear = getattr(module, "cpu_linear", None)
        weight = getattr(module, "weight", None)
        if (
            linear is None
            or linear is _torch_linear
            or getattr(module, "_weight_bridge_repack", None)
        ):
            continue
        if isinstance(weight, torch.Tensor) and id(weight) in tied:
            bad.append(f"{module_name}.weight")
    return bad
