"""Every use the bridge makes of vLLM's private internals, and every patch of vLLM, in one place.

This package is the bottom of the vLLM layer: it imports nothing from the project and exports
nothing (each name is imported from its module: :mod:`.patches`, :mod:`.versions`, :mod:`.sites`,
...). Nothing else in the project assigns onto a vLLM class, module or layer
(``tests/test_internals.py`` checks it): the modules that own the logic
(:mod:`~weight_bridge.vllm.worker.load_recording`, :mod:`~weight_bridge.vllm.core.updates`,
:mod:`~weight_bridge.vllm.server.typed_errors`, :mod:`~weight_bridge.vllm.worker.refresh`) hand
their wrappers (``original -> wrapped``) to the ``patch_*`` functions of :mod:`.patches`, which
:func:`~weight_bridge.vllm.plugin.register` calls once per process. Each ``patch_*`` checks every
site it patches before patching any and raises a ``RuntimeError`` naming a missing one. What is
only read lives in :mod:`.engine_core`, :mod:`~weight_bridge.vllm.internals.engine_client` and
:mod:`.model`. A minor version not in :data:`.versions.TESTED_VLLM` is refused
(:func:`.versions.check_vllm_version`) unless ``WEIGHT_BRIDGE_ALLOW_UNTESTED_VLLM=1``.

Upgrade checklist: on a new vLLM, check each site below (paths under ``vllm.``; each item says
what the bridge relies on it doing; ``tests/test_internals.py`` checks that every site of
:data:`.sites.SITES` and of the installed version's :data:`.sites.SITES_BY_VERSION` entry exists),
run the whole suite on it, add its entry to :data:`.sites.SITES_BY_VERSION` and its minor version
to :data:`.versions.TESTED_VLLM`. What differs between the tested versions:

* **0.32**: runner ``v1.worker.gpu_model_runner.GPUModelRunner``; no direct reload of vLLM's own
  (``reload_mode="vllm-direct"`` is refused by name). ``WeightSource.metadata()`` is a method and
  the source is iterated; ``pause_generation(mode="wait")`` queues new requests.
* **0.34**: runners ``v1.worker.gpu.model_runner.GPUModelRunner`` and, on the CPU,
  ``v1.worker.cpu.standalone_model_runner.StandaloneCPUModelRunner``; vLLM's direct reload (site
  20) is what ``"vllm-direct"`` rides (:mod:`~weight_bridge.vllm.worker.vllm_direct`; it refuses
  a stock CPU engine, whose linear dispatch replaces parameter objects, not a bridged one).
  ``WeightSource.metadata`` is a property, tensors come from ``iter_full()`` / ``iter_local()``
  with ``ParamMeta.owners``; ``pause_generation(mode="wait")`` rejects new requests until resume,
  which the bridge's ``drain`` avoids (site 19, :mod:`.pause`).

1. ``model_loader.default_loader.DefaultModelLoader.get_all_weights(self, model_config, model)``
   (yields ``(name, tensor)``) and ``.load_weights(self, model, model_config)``: patched; the
   default loader's path from the checkpoint into the model.
2. ``model_loader.base_loader.process_weights_after_loading(model, model_config,
   target_device)``: patched as the module global ``load_model`` looks up at call time.
3. Each module's own ``process_weights_after_loading`` (its ``quant_method``'s,
   ``QuantizeMethodBase``, or an attention layer's, ``layers.attention
   .is_deferred_attention_layer``): wrapped on the instance while processing runs; what vLLM's
   layerwise path re-runs.
4. ``v1.engine.core.EngineCore.collective_rpc(self, method, timeout, args, kwargs)``: patched;
   ``LLM``, ``AsyncLLM`` and the HTTP routes reach ``start_weight_update``, ``update_weights``,
   ``finish_weight_update`` through it; a callable ``method`` runs in every worker as
   ``method(worker, *args)`` (the bridge's one channel into the workers, ``call_backend``, also
   reached by the name ``"weight_bridge.call_backend"``).
5. Engine-core utilities ``weight_bridge_results`` / ``weight_bridge_conflict``, added to
   ``EngineCore`` and found with ``getattr(core, name)`` (``EngineCoreProc
   ._handle_client_request``); ``InprocClient.engine_core`` is the core.
6. ``resume_scheduler`` of ``EngineCore`` and of each subclass that overrides it
   (``DPEngineCoreProc``): patched.
7. The logger ``vllm.v1.engine.core``: a filter; a failed utility call is logged there with
   ``exc_info``.
8. ``entrypoints.rl.offline.RLOfflineMixin`` and ``v1.engine.async_llm.AsyncLLM``:
   ``update_weights(self, request)`` and ``start_weight_update(self)`` patched; an engine-core
   error reaches the caller as an exception carrying its message.
9. ``model_executor.layers.utils.dispatch_cpu_unquantized_gemm(layer, remove_weight)``: patched
   as the module attribute (its callers import it at call time); it sets ``layer.cpu_linear``,
   which generation calls. Read by :func:`~.model.is_input_embedding`:
   ``layers.vocab_parallel_embedding.VocabParallelEmbedding`` (its forward looks rows up in the
   weight; only ``apply``, for logits, calls ``cpu_linear``) and its subclass ``ParallelLMHead``.
10. ``layers.fused_moe.experts.cpu_moe.CPUUnquantizedExperts.process_weights_after_loading(self,
    layer)``: patched; it prepacks ``w13_weight`` / ``w2_weight`` (same shape and dtype).
11. Read by :func:`~.engine_core.forget_prefixes`: ``EngineCore.scheduler``,
    ``.reset_prefix_cache()`` (True if it reset), ``Scheduler.running``,
    ``.kv_cache_manager.coordinator.single_type_managers[*].block_pool`` (``blocks``,
    ``_maybe_evict_cached_block``, ``cached_block_hashes_by_block``), ``Request._block_hasher``;
    by :func:`~.engine_core.requests_with_lora`: ``Scheduler.requests`` (unfinished ones,
    ``Request.is_finished()``), ``Request.lora_request.lora_int_id``.
12. Scheduling stopped and restored: ``Scheduler.pause_state``, ``.set_pause_state``,
    ``.reset_prefix_cache(reset_running_requests=True)``, ``PauseState.PAUSED_ALL``.
13. ``EngineCore._weight_version``: the label stamped on outputs
    (:func:`~.engine_core.served_version`); ``EngineCore.set_weight_version`` patched (a label
    naming a resident adapter version does not relabel the base weights).
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
    ``model_runner.get_model()``, ``model_runner.reset_encoder_cache()`` / ``.reset_mm_cache()``.
17. The API server (:mod:`~weight_bridge.vllm.server.middleware`): ``request.app.state
    .engine_client`` is the ``AsyncLLM``, its ``engine_core.call_utility_async(name)`` reaches
    the utilities of item 5; the RL routes (``/start_weight_update``, ``/update_weights``,
    ``/finish_weight_update``, ``/pause``, ``/resume``, ``/weight_info``) answer under
    ``VLLM_SERVER_DEV_MODE=1`` only (``request.app.routes`` has ``/resume`` then);
    ``request.app.state.args.api_key`` holds the ``--api-key`` keys and
    ``engine_client.vllm_config`` the engine's config. The served names
    (:mod:`~weight_bridge.vllm.internals.objects`): ``request.app.state.openai_serving_models``
    (``OpenAIServingModels``; its ``base_model_paths``, a list of ``BaseModelPath(name,
    model_path)`` that ``is_base_model`` reads, the first the served name; ``lora_requests``,
    ``{name: LoRARequest}``, looked up before the base names by every generation route's
    ``_maybe_get_adapters``, and a name in neither answered ``404``; ``show_available_models()``,
    a ``ModelList`` listing a LoRA by its ``lora_name``), on ``/v1/completions`` and 0.32's
    ``/inference/v1/generate`` alike.
18. Shared-memory message queues (``distributed.device_communicators.shm_broadcast
    .SpinCondition.wait(self, timeout_ms)``: spins while the last message came less than
    ``busy_loop_s`` ago, else sleeps until the writer's notification, which every ``enqueue``
    sends): ``wait`` patched (an idle bridged CPU worker sleeps); read by
    :func:`~.engine_core.waiting_without_spinning`: ``EngineCore.model_executor.response_mqs``
    (``MultiprocExecutor``), each queue's ``_spin_condition.busy_loop_s`` (0 during a bridged
    update, restored after).
19. The ``drain`` pause (:func:`~.pause.pause_queueing`): ``AsyncLLM.engine_core
    .pause_scheduler_async(mode, clear_cache)`` reaches the engine core's ``pause_scheduler``,
    which queues requests arriving while paused; ``resume_generation`` releases them, and
    ``AsyncLLM.is_paused()`` says whether the scheduler is paused (:func:`~.pause.release_pause`).
20. (0.34+) vLLM's direct reload, ``model_loader.reload.direct``: ``record_checkpoint_layout``
    (called by the bridge's load recording, before post-load processing), ``begin_direct_reload``,
    ``finish_direct_reload(model, model_config, device)``, its checks ``_check_params_kept`` /
    ``_checkpoint_views`` (raise ``RuntimeError``, change nothing), the model's
    ``_ckpt_param_names`` (:mod:`.vllm_direct`).
21. The CPU worker's distributed start (``v1.worker.cpu_worker``): it sets ``VLLM_DIST_IDENT``
    from its init method's port just before calling its module's
    ``init_worker_distributed_environment``, whose tensor-parallel communicators name their
    shared memory after it; that call is patched on the CPU, so an engine in the trainer's ranks
    names them by the job's ``MASTER_PORT`` (:mod:`~weight_bridge.vllm.worker.external_launcher`).
    The engine core in the trainer's ranks reads ``distributed.parallel_state.get_world_group()
    .cpu_group`` and its config's ``parallel_config.distributed_executor_backend`` and
    ``world_size`` (:func:`~.engine_core.across_engine_ranks`); a shutdown's
    ``cleanup_dist_env_and_memory`` destroys the default process group, which the bridge keeps
    (:func:`~.engine_client.shutdown`).
22. LoRA (:mod:`.lora`): ``v1.worker.lora_model_runner_mixin.LoRAModelRunnerMixin
    .reset_lora_state`` (called by the worker's ``finish_weight_update``; drops every adapter)
    is patched to skip once unless the update wrote base weights; the model's ``lora_manager`` (the
    ``LRUCacheLoRAModelManager``): ``modules`` (each with ``lora_a_stacked`` /
    ``lora_b_stacked``: a tuple per packed slice, or one tensor; shape ``(max_loras, 1, rows,
    cols)``), ``packed_modules``, ``lora_index_to_id``, ``lora_config.max_lora_rank``,
    ``add_adapter`` / ``activate_adapter`` / ``pin_adapter`` / ``remove_adapter`` /
    ``list_adapters``, the LRU caches' ``pinned_items``; ``lora.lora_model.LoRAModel(id, rank,
    loras)``, ``lora.lora_weights.LoRALayerWeights(name, rank, alpha, a, b, scaling)``,
    ``lora.utils.parse_fine_tuned_lora_name`` and the model's ``hf_to_vllm_mapper``.
23. Online FP8 (``model_executor.layers.quantization.online.fp8``):
    ``Fp8PerTensorOnlineLinearMethod`` and ``Fp8PtpcOnlineLinearMethod``
    ``.process_weights_after_loading(self, layer)``: patched
    (:mod:`~weight_bridge.vllm.worker.fp8_requant`); it reads the layer's bf16 ``weight`` (N, K)
    and the attributes its linear layer sets (``tp_size``, ``input_size``...), and leaves
    ``weight`` FP8 (K, N), a transposed view, and ``weight_scale`` float32 (0.32's
    ``replace_parameter`` registers new parameters without ``output_dim``/``input_dim``);
    ``_already_called_process_weights_after_loading`` marks a processed layer; the model's
    ``packed_modules_mapping`` names each fused module's checkpoint shards.
24. The front end's labels (``v1.engine.output_processor.RequestState``): its ``lora_name`` (the
    request's ``LoRARequest.lora_name``) and ``track_weight_version(self, weight_version)``, called
    with the engine's label for each step that gave the request tokens; patched so that a request
    sampled with an adapter version the bridge pushed is labelled with that version (:mod:`.lora`).
"""
