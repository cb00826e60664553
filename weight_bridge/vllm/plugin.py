"""vLLM general plugin: register the backend, install the bridge's patches of vLLM.

vLLM runs ``register`` in every process it starts (entry point group ``vllm.general_plugins``):
the API server or ``LLM`` process, the engine core, every worker. It registers the
``weight_bridge`` weight-transfer backend (:mod:`~weight_bridge.vllm.worker.backend`) and its
trainer side in vLLM's factories (vLLM's own API) and, on a tested vLLM
(:mod:`~weight_bridge.vllm.internals.versions`), installs, through
:mod:`~weight_bridge.vllm.internals` (the one place that patches vLLM), the project's wrappers:

* the default model loader's: the layout and its proof recorded at load
  (:mod:`~weight_bridge.vllm.worker.load_recording`);
* the engine core's: each update a transaction over every rank
  (:mod:`~weight_bridge.vllm.core.updates`);
* ``LLM`` and ``AsyncLLM``'s ``update_weights``: typed errors in every process
  (:mod:`~weight_bridge.vllm.server.typed_errors`);
* on the CPU backend, its processing: the refreshers of derived state
  (:mod:`~weight_bridge.vllm.worker.refresh`).

On an untested vLLM nothing is patched (vLLM runs as it is for every engine that is not bridged)
and a bridged engine is refused when its backend is built, naming the checklist and the opt-in.

Every wrapper is inert unless the engine is bridged (:func:`~weight_bridge.vllm.options.is_bridged`:
started with ``weight_transfer_config={"backend": "weight_bridge"}``). Then the engine plugins
listed in :data:`PLUGINS_ENV` run.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os

from .core import adapters as core_adapters
from .core import undefined as core_undefined
from .core import updates as core_updates
from .internals import lora, patches, versions
from .internals.inductor_cache_isa import apply as apply_isa_cache_key
from .lifeline import follow_parent
from .options import BACKEND
from .server import typed_errors
from .worker import cpu_threads, external_launcher, fp8_requant, load_recording, refresh

PLUGINS_ENV = "WEIGHT_BRIDGE_PLUGINS"
_registered = False
_plugins_run: set[str] = set()


def _register_backend() -> None:
    """The ``weight_bridge`` backend in vLLM's weight-transfer factories, engine and trainer
    side, loaded lazily by module path (a second registration is a no-op)."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, module, cls in (
        (WeightTransferEngineFactory, "weight_bridge.vllm.worker.backend", "WeightBridgeEngine"),
        (
            WeightTransferTrainerFactory,
            "weight_bridge.vllm.clients.trainer_api",
            "WeightBridgeTrainer",
        ),
    ):
        with contextlib.suppress(ValueError):  # registered already in this process
            factory.register_engine(BACKEND, module, cls)


def run_engine_plugins(specs: str | None = None) -> None:
    """Call each ``module:function`` of ``specs`` (default: :data:`PLUGINS_ENV`), once each.

    This is how an engine gets out-of-tree architectures (``ModelRegistry.register_model``)
    without anything being registered in every vLLM process of the environment:
    :class:`~weight_bridge.ColocatedEngine` puts its ``plugins`` in the environment its
    engine processes inherit, and each of them calls them here.
    """
    listed = specs if specs is not None else os.environ.get(PLUGINS_ENV, "")
    for spec in filter(None, listed.split(",")):
        if spec in _plugins_run:
            continue
        module, _, func = spec.partition(":")
        getattr(importlib.import_module(module), func or "register")()
        _plugins_run.add(spec)


def _install_patches() -> None:
    from vllm.platforms import current_platform

    patches.patch_default_loader(
        get_all_weights=load_recording.get_all_weights,
        load_weights=load_recording.load_weights,
        process_weights_after_loading=load_recording.process_weights_after_loading,
    )
    patches.patch_engine_core(
        collective_rpc=core_updates.bridged_collective_rpc,
        set_weight_version=core_adapters.labelling_the_base,
        resume_scheduler=core_undefined.releasing_resume,
        step=core_undefined.failing_while_undefined,
        utilities=core_updates.UTILITIES,
        log_filter=core_updates.quiet_refusals,
    )
    patches.patch_rl_api(
        update_weights=typed_errors.typed_update_weights,
        update_weights_async=typed_errors.typed_update_weights_async,
        start_weight_update=typed_errors.typed_start_weight_update,
        start_weight_update_async=typed_errors.typed_start_weight_update_async,
    )
    patches.patch_lora_reset(lora.keeping_adapters)
    patches.patch_token_labels(lora.labelling_adapter_tokens)
    patches.patch_online_fp8(fp8_requant.process_online_fp8)
    if current_platform.is_cpu():
        patches.patch_cpu_linear(refresh.dispatch_cpu_linear)
        patches.patch_cpu_moe(refresh.process_cpu_moe)
        patches.patch_queue_waits(cpu_threads.idle_wait)
        patches.patch_cpu_dist_init(external_launcher.naming_shm_by_job)


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group; safe to call many times."""
    global _registered
    if _registered:
        return
    _registered = True
    follow_parent()
    apply_isa_cache_key()  # logprobs compiled for another CPU's vector width: wrong (issue 58)
    _register_backend()
    try:
        versions.check_vllm_version()
    except versions.UntestedVLLMError as exc:
        logging.getLogger(__name__).warning("%s; weight-bridge patches nothing here", exc)
        return
    _install_patches()
    run_engine_plugins()
