"""vLLM general plugin: record the checkpoint layout at load, keep CPU linears reloadable.

vLLM runs ``register`` in every engine and worker process (entry point group
``vllm.general_plugins``). The patches it installs are inert unless the engine was created
through the bridge, i.e. its ``additional_config`` holds a ``weight_bridge`` entry.

What the patches do for a bridged engine:

1. While the default loader streams the checkpoint into the model, the name, shape and dtype
   of every checkpoint tensor are noted on the model (the checkpoint a push must match).
2. After the weights are in and before post-load processing runs, the parameter layout is
   recorded with :func:`weight_bridge.layout.record_checkpoint_layout`.
3. On the CPU backend, post-load processing packs each linear weight into a oneDNN handle and
   empties the parameter, which makes it impossible to reload in place. ``cpu_linear`` picks
   what the bridge does instead:

   * ``"repack"`` (default): let vLLM pack as usual but keep the weight; after each direct
     write the packed form is derived again from it (:func:`refresh_derived_state`). Generation
     runs at vLLM's own speed; memory holds each linear twice (weight and packed copy).
   * ``"torch"``: keep the weight and compute with ``torch.nn.functional.linear`` on it, so the
     live parameter *is* what generation reads; nothing derived to refresh, but generation is
     slower (measured 0.58x stock by ``make bench``).
   * ``"stock"``: vLLM's own behaviour; direct reload refuses those weights (``auto`` falls
     back to layerwise).
"""

from __future__ import annotations

from typing import Any

import torch

from ..layout import TensorSpec, record_checkpoint_layout

__all__ = ["BRIDGE_KEY", "CPU_LINEAR_MODES", "bridge_options", "refresh_derived_state", "register"]

BRIDGE_KEY = "weight_bridge"
CPU_LINEAR_MODES = ("torch", "repack", "stock")
MANIFEST_ATTR = "_weight_bridge_checkpoint"
_REPACK_ATTR = "_weight_bridge_repack"
_registered = False


def bridge_options(vllm_config: Any = None) -> dict | None:
    """The bridge's options of the engine being built or run here, or None if not bridged."""
    if vllm_config is None:
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
    extra = getattr(vllm_config, "additional_config", None)
    if isinstance(extra, dict) and isinstance(extra.get(BRIDGE_KEY), dict):
        return extra[BRIDGE_KEY]
    return None


def _torch_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


def _patch_loader() -> None:
    from vllm.model_executor.model_loader import base_loader, default_loader

    loader_cls = default_loader.DefaultModelLoader
    original_weights = loader_cls.get_all_weights

    def get_all_weights(self, model_config, model):
        if bridge_options() is None:
            yield from original_weights(self, model_config, model)
            return
        manifest: dict[str, TensorSpec] = {}
        setattr(model, MANIFEST_ATTR, manifest)
        for name, tensor in original_weights(self, model_config, model):
            manifest[name] = TensorSpec(tuple(tensor.shape), tensor.dtype)
            yield name, tensor

    loader_cls.get_all_weights = get_all_weights  # type: ignore[method-assign]

    original_process = base_loader.process_weights_after_loading

    def process_weights_after_loading(model, model_config, target_device):
        if bridge_options() is not None:
            manifest = getattr(model, MANIFEST_ATTR, None)
            if manifest is None:
                raise RuntimeError(
                    "weight-bridge: the engine's model loader did not stream a checkpoint "
                    "(only the default safetensors loader is supported)"
                )
            record_checkpoint_layout(model, checkpoint=manifest)
        return original_process(model, model_config, target_device)

    base_loader.process_weights_after_loading = process_weights_after_loading


def _patch_cpu_linear() -> None:
    from vllm.model_executor.layers import utils as layer_utils

    original = layer_utils.dispatch_cpu_unquantized_gemm

    def dispatch_cpu_unquantized_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
        opts = bridge_options()
        mode = (opts or {}).get("cpu_linear", "stock")
        weight = getattr(layer, "weight", None)
        plain = isinstance(weight, torch.Tensor) and not weight.is_meta and weight.ndim == 2
        if mode == "stock" or not plain:
            original(layer, remove_weight)
        elif mode == "torch":
            setattr(layer, "cpu_linear", _torch_linear)  # noqa: B010 (nn.Module attribute)
        elif mode == "repack":
            original(layer, remove_weight=False)
            setattr(layer, _REPACK_ATTR, original)
        else:
            raise ValueError(f"weight-bridge: cpu_linear must be one of {CPU_LINEAR_MODES}")

    layer_utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm


def refresh_derived_state(model: torch.nn.Module) -> int:
    """Re-derive state that post-load processing computed from weights; returns how many layers.

    Only ``cpu_linear="repack"`` creates such state (the packed oneDNN copy of each linear).
    """
    refreshed = 0
    for module in model.modules():
        repack = getattr(module, _REPACK_ATTR, None)
        if repack is not None:
            repack(module, remove_weight=False)
            refreshed += 1
    return refreshed


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group; safe to call many times."""
    global _registered
    if _registered:
        return
    _registered = True
    _patch_loader()
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        _patch_cpu_linear()
    from .relocating_model import register_relocating_models

    register_relocating_models()
