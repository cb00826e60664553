"""What the bridge reads and drives in vLLM's model layers and workers (sites 3, 15 and 16 of the
checklist in :mod:`weight_bridge.vllm.internals`): which modules vLLM's layerwise reload
re-processes, that reload's internals, the worker's backend, model and caches."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from weakref import WeakKeyDictionary


def layerwise_reprocesses(module: Any) -> bool:
    """Whether vLLM's layerwise path re-runs this module's post-load processing."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    return isinstance(getattr(module, "quant_method", None), QuantizeMethodBase) or bool(
        is_deferred_attention_layer(module)
    )


_quantized: WeakKeyDictionary[Any, dict[str, str]] = WeakKeyDictionary()


def quantized_layers(model: Any) -> dict[str, str]:
    """The layers whose weights vLLM holds quantized, by name -> their quantization method:
    a linear or MoE method that is not one of vLLM's unquantized ones (nor a subclass of one).
    vLLM computes such a layer with bytes and scales it derived from the float weights at
    load; a float written into them is not what a cold start holds. (Named by the classes'
    MRO, so that a method of either vLLM counts, and a KV-cache method does not.) Walked once
    per model, at its first push (every push asks): a layer's method is chosen when the model
    is built, and the LoRA wrapping that renames layers is done before any push."""
    found = _quantized.get(model)
    if found is None:
        found = _quantized[model] = {}
        for name, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            kinds = {c.__name__ for c in type(method).__mro__} if method is not None else set()
            weights = bool(kinds & {"LinearMethodBase", "FusedMoEMethodBase"})
            if weights and not any(k.startswith("Unquantized") for k in kinds):
                found[name] = type(method).__name__
    return dict(found)


def is_input_embedding(layer: Any) -> bool:
    """Whether ``layer`` is a vocabulary embedding that is not a logits head (site 9). On the
    CPU backend vLLM packs such a layer's weight into a oneDNN handle too
    (``UnquantizedEmbeddingMethod.process_weights_after_loading``), for ``apply``, which
    computes logits; its own forward looks rows up in the weight. A tied model's logits come
    from its ``ParallelLMHead`` (sharing the weight, packed on its own), so that handle is
    used only by a model whose logits are computed with the embedding module itself."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    return isinstance(layer, VocabParallelEmbedding) and not isinstance(layer, ParallelLMHead)


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


def fused_shards(model: Any, module: str) -> list[str]:
    """The checkpoint names of the weight that ``module`` of ``model`` loads, in load order:
    one per shard of a fused module (``qkv_proj``: ``q_proj``, ``k_proj``, ``v_proj``, from the
    model's ``packed_modules_mapping``, site 23), else its own."""
    parent, _, leaf = module.rpartition(".")
    shards = getattr(model, "packed_modules_mapping", {}).get(leaf, [leaf])
    return [f"{parent}.{shard}.weight" if parent else f"{shard}.weight" for shard in shards]


# what a linear's weight loader narrows and places shards by (site 23: 0.32's
# ``replace_parameter`` drops them from the FP8 parameter it registers)
_LOADER_DIMS = ("output_dim", "input_dim", "packed_dim", "packed_factor")


def loader_dims(param: Any) -> dict[str, Any]:
    """The attributes of a linear's float ``param`` its weight loader reads (site 23)."""
    return {d: getattr(param, d) for d in _LOADER_DIMS if hasattr(param, d)}


def restore_loader_dims(param: Any, dims: dict[str, Any]) -> None:
    """Put back on the quantized ``param`` the loader attributes (:func:`loader_dims`) its
    float one had, so the model's own loader can write the next floats through it."""
    for d, value in dims.items():
        if not hasattr(param, d):
            setattr(param, d, value)


def fp8_scratch(layer: Any, weight: Any) -> Any:
    """A module an online FP8 method can quantize ``weight`` on (site 23) without touching
    ``layer``: its public attributes (sizes, ``tp_size``, ``quant_method``, which decides how
    ``replace_parameter`` stores the result), ``weight`` and a copy of its scale."""
    import torch

    scratch = torch.nn.Module()
    scratch.__dict__.update({k: v for k, v in vars(layer).items() if not k.startswith("_")})
    scratch.weight = torch.nn.Parameter(weight, requires_grad=False)
    scale = layer.get_parameter("weight_scale").detach().clone()
    scratch.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
    return scratch
