"""vLLM general plugin: register the backend, record the layout and its proof at load.

vLLM runs ``register`` in every process it starts (entry point group ``vllm.general_plugins``):
the API server or ``LLM`` process, the engine core, every worker. It registers the
``weight_bridge`` weight-transfer backend (:mod:`.backend`) and its trainer side in vLLM's
factories, installs the engine-core side of an update (:mod:`.core_hooks`), and patches vLLM's
default model loader; every patch is inert unless the engine is bridged
(:func:`~.options.is_bridged`: started with ``weight_transfer_config={"backend":
"weight_bridge"}``).

What the loader patches do for a bridged engine:

1. While the default loader streams the checkpoint into the model, the name, shape and dtype
   of every checkpoint tensor are noted (the checkpoint an update must match), and which
   parameters the loader wrote into (a complete update must write each of them again).
2. After the weights are in and before post-load processing runs, the parameter layout, a
   fingerprint of every weight and a snapshot of every module are recorded
   (:func:`weight_bridge.direct.record_checkpoint_layout`).
3. During processing, each module's state right after its own quantization method (or
   attention layer) processed it is noted: a module whose state did not change after that is
   one vLLM's layerwise path can re-process by itself.
4. On the CPU backend, glibc keeps freed buffers for reuse in the engine's process
   (:mod:`.allocator`), so the packed state re-derived on every push reuses memory already
   faulted in.
5. After processing, the proof (:func:`weight_bridge.direct.prove_checkpoint_layout`) compares
   what processing left with what was recorded, with the refreshers of
   :mod:`weight_bridge.vllm.refresh` declaring the derived state the bridge re-derives.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from typing import Any
from weakref import WeakKeyDictionary

import torch

from ..direct import prove_checkpoint_layout, record_checkpoint_layout
from ..direct.readback import ReadBack
from ..direct.snapshot import snapshot_module
from ..direct.state import bridge_state
from ..layout import TensorSpec, fingerprint, live_tensors, storage_ptr
from .allocator import keep_freed_memory
from .layerwise import reprocessable_module
from .lifeline import follow_parent
from .options import BACKEND, bridge_options
from .refresh import install as install_refreshers
from .refresh import take_refreshers

__all__ = ["PLUGINS_ENV", "register", "run_engine_plugins"]

PLUGINS_ENV = "WEIGHT_BRIDGE_PLUGINS"
_manifests: WeakKeyDictionary[torch.nn.Module, dict[str, TensorSpec]] = WeakKeyDictionary()
_loaded: WeakKeyDictionary[torch.nn.Module, set[str]] = WeakKeyDictionary()
_registered = False
_plugins_run: set[str] = set()


def _sampled(t: torch.Tensor) -> Any:
    """Fingerprint of at most 64 Ki evenly spaced values: enough to see that a later step
    rewrote a weight (a transform rewrites nearly every value), at a fraction of a full pass."""
    flat = t.detach().reshape(-1)
    step = max(1, flat.numel() // 65536)
    return fingerprint(flat[::step])


def _watch_processing(model: torch.nn.Module) -> tuple[dict[int, Any], list]:
    """Note each module's state right after its own processing step (see point 3 above)."""
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

    loader_cls = default_loader.DefaultModelLoader
    original_weights = loader_cls.get_all_weights
    original_load = loader_cls.load_weights

    def get_all_weights(self, model_config, model):
        if bridge_options() is None:
            yield from original_weights(self, model_config, model)
            return
        manifest: dict[str, TensorSpec] = {}
        _manifests[model] = manifest
        for name, tensor in original_weights(self, model_config, model):
            manifest[name] = TensorSpec(tuple(tensor.shape), tensor.dtype)
            yield name, tensor

    def load_weights(self, model, model_config):
        if bridge_options() is None:
            return original_load(self, model, model_config)
        _keep_freed_memory()
        live = list(live_tensors(model))
        watch = ReadBack({storage_ptr(t) for _, t, _ in live}, "off")
        with watch:
            out = original_load(self, model, model_config)
        _loaded[model] = {name for name, t, _ in live if watch.wrote_into(t)}
        return out

    loader_cls.get_all_weights = get_all_weights  # type: ignore[method-assign]
    loader_cls.load_weights = load_weights  # type: ignore[method-assign]

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
        record_checkpoint_layout(model, checkpoint=manifest, loaded=_loaded.pop(model, None))
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


def _keep_freed_memory() -> None:
    """On the CPU backend, a bridged engine's process keeps freed packed buffers for reuse
    (:mod:`.allocator`): each push re-packs every linear."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        keep_freed_memory()


def _register_backend() -> None:
    """The ``weight_bridge`` backend in vLLM's weight-transfer factories, engine and trainer
    side, loaded lazily by module path (a second registration is a no-op)."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, module, cls in (
        (WeightTransferEngineFactory, "weight_bridge.vllm.backend", "WeightBridgeEngine"),
        (WeightTransferTrainerFactory, "weight_bridge.vllm.trainer", "WeightBridgeTrainer"),
    ):
        with contextlib.suppress(ValueError):  # registered already in this process
            factory.register_engine(BACKEND, module, cls)


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
    _register_backend()
    _patch_loader()
    from vllm.platforms import current_platform

    from .api_hooks import install as install_api_hooks
    from .core_hooks import install as install_core_hooks

    install_core_hooks()
    install_api_hooks()
    if current_platform.is_cpu():
        install_refreshers(bridge_options)
    run_engine_plugins()
