"""Worker extension: what :class:`~weight_bridge.vllm.ColocatedEngine` asks every worker besides
an update (which goes through vLLM's own weight-transfer calls and the ``weight_bridge``
backend).

vLLM mixes this class into its worker (``worker_extension_cls``); the engine calls the methods
by name through ``collective_rpc``, so they run in each worker (each tensor-parallel rank).
Only small plain values cross the process boundary.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch

from ..direct import plan_direct_reload
from ..direct.proof import module_of
from ..direct.snapshot import addresses
from ..direct.state import bridge_state, undefined_reason
from .layerwise import auto_reprocessable
from .options import bridge_options

__all__ = ["WeightBridgeWorkerExtension"]


class WeightBridgeWorkerExtension:
    """Methods vLLM adds to its worker; ``self`` is the worker."""

    model_runner: Any
    vllm_config: Any

    def _bridge_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()

    def weight_bridge_plan(self, mode: str = "direct") -> dict:
        """A dry run: per name, its write target, refresh, re-processing or refusal."""
        model = self._bridge_model()
        state = bridge_state(model)
        if state.layout is None:
            return {"error": "no checkpoint layout recorded: was the engine bridged?"}
        reprocessable = auto_reprocessable(model) if mode == "auto" else set()
        plan = plan_direct_reload(model, reprocessable)
        relocated = {r.name: asdict(r) for r in plan.relocations}
        proof = state.proof
        options = bridge_options(self.vllm_config)
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
            "options": asdict(options) if options is not None else None,
        }

    def weight_bridge_addresses(self) -> dict[str, tuple]:
        """Every parameter/buffer name -> (data_ptr, shape, stride, dtype)."""
        return addresses(self._bridge_model())

    def weight_bridge_undefined(self) -> str | None:
        """Why this worker's weights are half-written, or None."""
        return undefined_reason(self._bridge_model())
