"""What the bridge reads and drives in vLLM's model layers and workers (sites 3, 15 and 16 of the
checklist in :mod:`weight_bridge.vllm.vllm_internals`): which modules vLLM's layerwise reload
re-processes, that reload's internals, the worker's backend, model and caches."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = [
    "layerwise_begin",
    "layerwise_finish",
    "layerwise_reprocesses",
    "reset_runner_caches",
    "transfer_engine",
    "worker_model",
]


def layerwise_reprocesses(module: Any) -> bool:
    """Whether vLLM's layerwise path re-runs this module's post-load processing."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    return isinstance(getattr(module, "quant_method", None), QuantizeMethodBase) or bool(
        is_deferred_attention_layer(module)
    )


def layerwise_begin(model: Any, modules: Iterable[str]) -> None:
    """Put ``modules`` of ``model`` back on the meta device for vLLM's layerwise processing,
    their kernel tensors kept to be written in place by :func:`layerwise_finish`."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        get_layerwise_info,
        initialize_online_processing,
    )
    from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta
    from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers

    for name in modules:
        layer = model.get_submodule(name)
        info = get_layerwise_info(layer)
        info.kernel_tensors = get_layer_params_buffers(layer)
        info.kernel_non_persistent_buffers = set(layer._non_persistent_buffers_set)
        restore_layer_on_meta(layer, info)
        initialize_online_processing(layer)


def layerwise_finish(model: Any, model_config: Any) -> None:
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_processing

    finalize_layerwise_processing(model, model_config)


def transfer_engine(worker: Any) -> Any:
    """The weight-transfer backend the worker built at ``load_model``, or None."""
    return getattr(worker, "weight_transfer_engine", None)


def worker_model(worker: Any) -> Any:
    return worker.model_runner.get_model()


def reset_runner_caches(worker: Any) -> None:
    """Encoder and multi-modal caches hold outputs of the old weights."""
    runner = worker.model_runner
    for name in ("reset_encoder_cache", "reset_mm_cache"):
        reset = getattr(runner, name, None)
        if callable(reset):
            reset()
