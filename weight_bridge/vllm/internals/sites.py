"""The upgrade checklist's sites as data (the checklist: :mod:`weight_bridge.vllm.internals`'s
docstring): each that is an attribute of a vLLM module or class, every one checked on the
installed vLLM by ``tests/test_internals.py``."""

from __future__ import annotations

from .patches import PATCHED
from .versions import vllm_minor
from .vllm_direct import VLLM_DIRECT_SITES

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
    "vllm.entrypoints.openai.models.serving.OpenAIServingModels.show_available_models",
    "vllm.entrypoints.openai.models.serving.OpenAIServingModels.is_base_model",
    "vllm.entrypoints.openai.models.protocol.BaseModelPath",
    "vllm.entrypoints.serve.engine.serving.BaseServing._maybe_get_adapters",
    "vllm.entrypoints.serve.engine.serving.BaseServing._check_model",
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
