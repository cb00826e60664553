"""vLLM general plugin: record the layout and its proof at load, keep derived state refreshable.

vLLM runs ``register`` in every engine and worker process (entry point group
``vllm.general_plugins``). The patches it installs are inert unless the engine was created
through the bridge, i.e. its ``additional_config`` holds a ``weight_bridge`` entry.

What the patches do for a bridged engine:

1. While the default loader streams the checkpoint into the model, the name, shape and dtype
   of every checkpoint tensor are noted (the checkpoint a push must match).
2. After the weights are in and before post-load processing runs, the parameter layout, a
   fingerprint of every weight and a snapshot of every module are recorded
   (:func:`weight_bridge.layout.record_checkpoint_layout`).
3. During processing, each module's state right after its own quantization method (or
   attention layer) processed it is noted: a module whose state did not change after that is
   one vLLM's layerwise path can re-process by itself.
4. After processing, the proof (:func:`weight_bridge.direct.prove_checkpoint_layout`) compares
   what processing left with what was recorded, with the refreshers of
   :mod:`weight_bridge.vllm.refresh` declaring the derived state the bridge re-derives.

``cpu_linear`` (CPU backend) picks what happens to linear layers, which vLLM packs into oneDNN
handles and empties:

* ``"repack"`` (default): vLLM packs as usual but the weight is kept; after each direct write
  the packed form is derived again. Generation runs at vLLM's own speed; memory holds each
  linear twice (weight and packed copy).
* ``"torch"``: the weight is kept and computed with by ``torch.nn.functional.linear``; nothing
  derived to refresh, but generation is slower (measured 0.53-0.58x stock by ``make bench``).
* ``"stock"``: vLLM's own behaviour; the emptied weights are re-processed by vLLM's layerwise
  path in ``auto`` mode and refused in ``direct`` mode.
"""

from __future__ import annotations

import importlib
import os
from typing import Any
from weakref import WeakKeyDictionary

import torch

from ..direct import prove_checkpoint_layout
from ..direct.proof import snapshot_module
from ..layout import TensorSpec, fingerprint, record_checkpoint_layout
from ..state import bridge_state
from .lifeline import follow_parent

__all__ = [
    "BRIDGE_KEY",
    "CPU_LINEAR_MODES",
    "PLUGINS_ENV",
    "bridge_options",
    "register",
    "run_engine_plugins",
    "torch_linear",
]

BRIDGE_KEY = "weight_bridge"
CPU_LINEAR_MODES = ("torch", "repack", "stock")
PLUGINS_ENV = "WEIGHT_BRIDGE_PLUGINS"
_manifests: WeakKeyDictionary[torch.nn.Module, dict[str, TensorSpec]] = WeakKeyDictionary()
_registered = False
_plugins_run: set[str] = set()


def bridge_options(vllm_config: Any = None) -> dict | None:
    """The bridge's options of the engine being built or run here, or None if not bridged."""
    if vllm_config is None:
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
    extra = getattr(vllm_config, "additional_config", None)
    if isinstance(extra, dict) and isinstance(extra.get(BRIDGE_KEY), dict):
        return extra[BRIDGE_KEY]
    return None


def torch_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``cpu_linear="torch"``: compute with the live weight itself."""
    return torch.nn.functional.linear(x, weight, bias)


def _sampled(t: torch.Tensor) -> Any:
    """Fingerprint of at most 64 Ki evenly spaced values: enough to see that a later step
    rewrote a weight (a transform rewrites nearly every value), at a fraction of a full pass."""
    flat = t.detach().reshape(-1)
    step = max(1, flat.numel() // 65536)
    return fingerprint(flat[::step])


def _watch_processing(model: torch.nn.Module) -> tuple[dict[int, Any], list]:
    """Note each module's state right after its own processing step (see point 3 above)."""
    from .layerwise import reprocessable_module

    after_own: dict[int, Any] = {}
    undo: list = []

    def note(module: torch.nn.Module) -> None:
        prints = {n: _sampled(p) for n, p in module.named_parameters(recurse=False)}
        after_own[id(module)] = (snapshot_module(module), prints)

    for module in model.modules():
        if not reprocessable_module(module):
            continue
        quant = getattr(module, "quant_method", None)
        owner, attr = (
            (quant, "process_weights_after_loading")
            if quant is not None
            else (
                module,
                "process_weights_after_loading",
            )
        )
        original = getattr(owner, attr, None)
        if original is None or attr in vars(owner):
            continue

        def wrapped(*args, _original=original, _module=module, **kwargs):
            out = _original(*args, **kwargs)
            note(_module)
            return out

        setattr(owner, attr, wrapped)
        undo.append((owner, attr))
    return after_own, undo


def _reprocessable(model: torch.nn.Module, after_own: dict[int, Any]) -> set[str]:
    out = set()
    for name, module in model.named_modules():
        noted = after_own.get(id(module))
        if noted is None:
            continue
        snap, prints = noted
        now = {n: _sampled(p) for n, p in module.named_parameters(recurse=False)}
        same_values = now.keys() == prints.keys() and all(prints[n].matches(now[n]) for n in prints)
        if snapshot_module(module) == snap and same_values:
            out.add(name)
    return out


def _patch_loader() -> None:
    from vllm.model_executor.model_loader import base_loader, default_loader

    from .refresh import take_refreshers

    loader_cls = default_loader.DefaultModelLoader
    original_weights = loader_cls.get_all_weights

    def get_all_weights(self, model_config, model):
        if bridge_options() is None:
            yield from original_weights(self, model_config, model)
            return
        manifest: dict[str, TensorSpec] = {}
        _manifests[model] = manifest
        for name, tensor in original_weights(self, model_config, model):
            manifest[name] = TensorSpec(tuple(tensor.shape), tensor.dtype)
            yield name, tensor

    loader_cls.get_all_weights = get_all_weights  # type: ignore[method-assign]

    original_process = base_loader.process_weights_after_loading

    def process_weights_after_loading(model, model_config, target_device):
        if bridge_options() is None:
            return original_process(model, model_config, target_device)
        manifest = _manifests.pop(model, None)
        if manifest is None:
            raise RuntimeError(
                "weight-bridge: the engine's model loader did not stream a checkpoint "
                "(only the default safetensors loader is supported)"
            )
        record_checkpoint_layout(model, checkpoint=manifest)
        after_own, undo = _watch_processing(model)
        try:
            out = original_process(model, model_config, target_device)
        finally:
            for owner, attr in undo:
                delattr(owner, attr)
        prove_checkpoint_layout(model, take_refreshers(model))
        bridge_state(model).reprocessable = _reprocessable(model, after_own)
        return out

    base_loader.process_weights_after_loading = process_weights_after_loading


def run_engine_plugins(specs: str | None = None) -> None:
    """Call each ``module:function`` of ``specs`` (default: :data:`PLUGINS_ENV`), once each.

    This is how an engine gets out-of-tree architectures (``ModelRegistry.register_model``)
    without anything being registered in every vLLM process of the environment:
    :class:`~weight_bridge.vllm.ColocatedEngine` puts its ``plugins`` in the environment its
    engine processes inherit, and each of them calls them here.
    """
    listed = specs if specs is not None else os.environ.get(PLUGINS_ENV, "")
    for spec in filter(None, listed.split(",")):
        if spec in _plugins_run:
            continue
        module, _, func = spec.partition(":")
        getattr(importlib.import_module(module), func or "register")()
        _plugins_run.add(spec)


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group; safe to call many times."""
    global _registered
    if _registered:
        return
    _registered = True
    follow_parent()
    _patch_loader()
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from .refresh import install

        install(bridge_options)
    run_engine_plugins()
