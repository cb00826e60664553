"""The layout and its proof, recorded while a bridged engine loads its checkpoint.

The plugin wraps vLLM's default model loader with the three wrappers here (through
:func:`~weight_bridge.vllm.internals.patches.patch_default_loader`); each is inert unless the
engine is bridged (:func:`~weight_bridge.vllm.options.bridge_options`: started with
``weight_transfer_config={"backend": "weight_bridge"}``). For a bridged engine:

1. While the default loader streams the checkpoint into the model, the name, shape and dtype
   of every checkpoint tensor are noted (the checkpoint an update must match), and which
   parameters the loader wrote into (a complete update must write each of them again).
2. After the weights are in and before post-load processing runs, the parameter layout, a
   fingerprint of every weight and a snapshot of every module are recorded
   (:func:`weight_bridge.direct.record_checkpoint_layout`).
3. During processing, each module's state right after its own quantization method (or
   attention layer) processed it is noted: a module whose state did not change after that is
   one vLLM's layerwise path can re-process by itself.
4. On the CPU backend, the worker's allocator and threads are set up for pushes
   (:mod:`~weight_bridge.vllm.worker.allocator`, :mod:`~weight_bridge.vllm.worker.cpu_threads`).
5. After processing, the proof (:func:`weight_bridge.direct.prove_checkpoint_layout`) compares
   what processing left with what was recorded, with the refreshers of
   :mod:`weight_bridge.vllm.worker.refresh` declaring the derived state the bridge re-derives.
"""

from __future__ import annotations

from typing import Any
from weakref import WeakKeyDictionary

import torch

from ...direct import prove_checkpoint_layout, record_checkpoint_layout
from ...direct.snapshot import snapshot_module
from ...direct.state import bridge_state
from ...layout import TensorSpec, fingerprint
from ..internals.model import layerwise_reprocesses
from ..internals.patches import processing_watched
from ..internals.vllm_direct import record_vllm_layout
from ..options import bridge_options
from .allocator import keep_freed_memory
from .cpu_threads import sleep_when_idle, use_spare_cpus
from .refresh import take_refreshers

_manifests: WeakKeyDictionary[torch.nn.Module, dict[str, TensorSpec]] = WeakKeyDictionary()


def _sampled(t: torch.Tensor) -> Any:
    """Fingerprint of at most 64 Ki evenly spaced values: enough to see that a later step
    rewrote a weight (a transform rewrites nearly every value), at a fraction of a full pass."""
    flat = t.detach().reshape(-1)
    step = max(1, flat.numel() // 65536)
    return fingerprint(flat[::step])


def _state_of(module: torch.nn.Module) -> tuple[Any, dict[str, Any]]:
    prints = {n: _sampled(p) for n, p in module.named_parameters(recurse=False)}
    return snapshot_module(module), prints


def _reprocessable(model: torch.nn.Module, after_own: dict[int, Any]) -> set[str]:
    """Modules whose state did not change after their own processing step (point 3)."""
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


def get_all_weights(original: Any) -> Any:
    """``DefaultModelLoader.get_all_weights``, noting every checkpoint tensor (point 1)."""

    def get_all_weights(self, model_config, model):
        if bridge_options() is None:
            yield from original(self, model_config, model)
            return
        manifest: dict[str, TensorSpec] = {}
        _manifests[model] = manifest
        for name, tensor in original(self, model_config, model):
            manifest[name] = TensorSpec(tuple(tensor.shape), tensor.dtype)
            yield name, tensor

    return get_all_weights


def load_weights(original: Any) -> Any:
    """``DefaultModelLoader.load_weights``, in a worker set up for the bridge's CPU work."""

    def load_weights(self, model, model_config):
        if bridge_options() is not None:
            _set_up_cpu_worker()
        return original(self, model, model_config)

    return load_weights


def process_weights_after_loading(original: Any) -> Any:
    """``base_loader.process_weights_after_loading``: record, watch, prove (points 2, 3, 5)."""

    def process_weights_after_loading(model, model_config, target_device):
        if bridge_options() is None:
            return original(model, model_config, target_device)
        manifest = _manifests.pop(model, None)
        if manifest is None:
            raise RuntimeError(
                "weight-bridge: the engine's model loader did not stream a checkpoint "
                "(only the default safetensors loader is supported)"
            )
        record_checkpoint_layout(model, checkpoint=manifest)
        record_vllm_layout(model)  # what reload_mode="vllm-direct" rides (vLLM 0.34+)
        after_own: dict[int, Any] = {}

        def note(module: torch.nn.Module) -> None:
            after_own[id(module)] = _state_of(module)

        watched = [m for m in model.modules() if layerwise_reprocesses(m)]
        with processing_watched(watched, note):
            out = original(model, model_config, target_device)
        prove_checkpoint_layout(model, take_refreshers(model))
        bridge_state(model).reprocessable = _reprocessable(model, after_own)
        return out

    return process_weights_after_loading


def _set_up_cpu_worker() -> None:
    """On the CPU backend, a bridged engine's worker keeps freed packed buffers for reuse
    (:mod:`~weight_bridge.vllm.worker.allocator`: each push re-packs every linear), waits for its
    next message asleep and gives its pushes helper threads on the CPUs vLLM leaves spare
    (:mod:`~weight_bridge.vllm.worker.cpu_threads`)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        keep_freed_memory()
        sleep_when_idle()
        use_spare_cpus()
