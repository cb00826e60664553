"""Colocated memory defaults: leave room for the trainer that shares the machine with the engine.

vLLM sizes its KV cache for a machine it has to itself: by default it reserves
``gpu_memory_utilization`` (0.92) of the GPU, or on the CPU backend of the node's RAM
(``CPUWorker.determine_available_memory``), and fills it with KV cache, leaving a colocated
trainer nothing. :func:`colocated_llm_kwargs` turns the user's ``vllm.LLM`` keywords into
colocated ones:

* ``kv_cache_gb`` (the one knob, :class:`~weight_bridge.ColocatedEngine`'s parameter): the KV
  cache per worker in GiB, on every backend, as vLLM's ``kv_cache_memory_bytes`` (the exact KV
  size on both the CPU and the CUDA worker);
* CPU, nothing chosen (no ``kv_cache_gb``, ``kv_cache_memory_bytes``, ``gpu_memory_utilization``
  nor ``VLLM_CPU_KVCACHE_SPACE``): :data:`CPU_DEFAULT_KV_CACHE_GB` GiB;
* CUDA, no ``gpu_memory_utilization``: :data:`CUDA_COLOCATED_UTILIZATION`, as colocated RL
  frameworks do;
* explicit settings always win and are left exactly as given (vLLM's CPU platform applies
  ``VLLM_CPU_KVCACHE_SPACE`` over any keyword: a warning says so when both are set).

A :class:`KVCacheTooSmallWarning` says when the KV cache cannot hold ``max_num_seqs x
max_model_len`` tokens: vLLM still starts but queues or preempts requests beyond what fits.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

GiB = 1 << 30
CPU_DEFAULT_KV_CACHE_GB = 1.0
CUDA_COLOCATED_UTILIZATION = 0.3
CPU_KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
# vLLM 0.32's max_num_seqs when the caller gives none (LLM class, per data-parallel world).
_VLLM_DEFAULT_MAX_NUM_SEQS = 256

_DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "fp8_ds_mla": 1,
    "int8": 1,
}


class KVCacheTooSmallWarning(UserWarning):
    """The engine's KV cache cannot hold ``max_num_seqs x max_model_len`` tokens."""


def _device(device: str | None) -> str:
    if device is not None:
        return device
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    return "cuda" if current_platform.is_cuda_alike() else str(current_platform.device_type)


def _model_config(model: str | os.PathLike) -> dict[str, Any] | None:
    path = Path(model) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return cfg.get("text_config", cfg) if isinstance(cfg, dict) else None


def _dtype_bytes(value: Any, cfg: dict[str, Any]) -> int | None:
    name = str(value).removeprefix("torch.") if value is not None else "auto"
    if name == "auto":
        cfg_dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
        # vLLM serves float32 checkpoints in 16 bits under "auto" (bfloat16 on CPU).
        return 2 if cfg_dtype in ("float32", "float") else _DTYPE_BYTES.get(cfg_dtype)
    return _DTYPE_BYTES.get(name)


def kv_bytes_per_token(model: str | os.PathLike, llm_kwargs: Mapping[str, Any]) -> int | None:
    """KV cache bytes one token takes in one worker (its tensor-parallel share of the heads),
    from the model's ``config.json``; None when the model is not a local directory or its
    attention is not the plain (grouped-query) kind this estimate knows. Sliding-window layers
    are counted as full attention (an over-estimate)."""
    cfg = _model_config(model)
    if cfg is None:
        return None
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    attention = {"full_attention", "sliding_attention"}
    if cfg.get("kv_lora_rank") or not set(cfg.get("layer_types") or []) <= attention:
        return None  # MLA or a hybrid (recurrent layers): not this estimate's shape
    kv_dtype = llm_kwargs.get("kv_cache_dtype", "auto")
    size = _dtype_bytes(llm_kwargs.get("dtype", "auto") if kv_dtype == "auto" else kv_dtype, cfg)
    if size is None:
        return None
    tp = int(llm_kwargs.get("tensor_parallel_size") or 1)
    return 2 * layers * max(1, math.ceil(kv_heads / tp)) * head_dim * size


def _cuda_total_bytes() -> int | None:
    try:
        import torch

        return int(torch.cuda.mem_get_info()[1]) if torch.cuda.is_available() else None
    except Exception:
        return None


def _weight_bytes(model: str | os.PathLike) -> int:
    try:
        return sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))
    except OSError:
        return 0


def colocated_llm_kwargs(
    model: str | os.PathLike,
    llm_kwargs: Mapping[str, Any],
    kv_cache_gb: float | None = None,
    device: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """``llm_kwargs`` with colocated memory defaults filled in (a new dict; the input is kept).

    ``kv_cache_gb``: the KV cache per worker in GiB (``kv_cache_memory_bytes``); conflicts with
    an explicit ``kv_cache_memory_bytes``. ``device``: ``"cpu"`` or ``"cuda"`` (default: vLLM's
    current platform). ``environ``: where to look for ``VLLM_CPU_KVCACHE_SPACE`` (``os.environ``).
    """
    env = os.environ if environ is None else environ
    out = dict(llm_kwargs)
    dev = _device(device)
    if kv_cache_gb is not None:
        if not kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb must be positive, not {kv_cache_gb!r}")
        if out.get("kv_cache_memory_bytes") is not None:
            raise ValueError("give kv_cache_gb or kv_cache_memory_bytes, not both")
        out["kv_cache_memory_bytes"] = int(kv_cache_gb * GiB)
    env_kv = env.get(CPU_KV_ENV, "") if dev == "cpu" else ""
    if dev == "cpu":
        if env_kv and out.get("kv_cache_memory_bytes") is not None:
            warnings.warn(
                f"{CPU_KV_ENV}={env_kv} in the environment overrides the KV cache size given "
                f"in code ({out['kv_cache_memory_bytes'] / GiB:.2f} GiB): vLLM's CPU platform "
                "applies the variable last",
                stacklevel=3,
            )
        chosen = env_kv or any(
            out.get(k) is not None for k in ("kv_cache_memory_bytes", "gpu_memory_utilization")
        )
        if not chosen:
            out["kv_cache_memory_bytes"] = int(CPU_DEFAULT_KV_CACHE_GB * GiB)
    elif dev == "cuda" and out.get("gpu_memory_utilization") is None:
        out["gpu_memory_utilization"] = CUDA_COLOCATED_UTILIZATION
    _warn_if_small(model, out, dev, env_kv)
    return out


def _warn_if_small(model: str | os.PathLike, kwargs: dict[str, Any], dev: str, env_kv: str) -> None:
    per_token = kv_bytes_per_token(model, kwargs)
    if not per_token:
        return
    cfg = _model_config(model) or {}
    max_len = kwargs.get("max_model_len") or cfg.get("max_position_embeddings")
    seqs = kwargs.get("max_num_seqs") or _VLLM_DEFAULT_MAX_NUM_SEQS
    if not max_len:
        return
    kv_bytes: float | None = None
    how = ""
    if env_kv:
        kv_bytes, how = float(env_kv) * GiB, f"{CPU_KV_ENV}={env_kv}"
    elif kwargs.get("kv_cache_memory_bytes") is not None:
        kv_bytes = float(kwargs["kv_cache_memory_bytes"])
        how = f"kv_cache_memory_bytes={int(kv_bytes)}"
    elif dev == "cuda":
        total = _cuda_total_bytes()
        if total:
            # Roughly: the engine's share of the device minus its weights and ~1 GiB of
            # activations and graphs (vLLM measures the real figure at startup).
            util = float(kwargs["gpu_memory_utilization"])
            kv_bytes = total * util - _weight_bytes(model) - GiB
            how = f"gpu_memory_utilization={util} (estimated)"
    if kv_bytes is None:
        return
    need = int(seqs) * int(max_len) * per_token
    if kv_bytes < need:
        fits = max(0, int(kv_bytes // per_token))
        warnings.warn(
            f"the engine's KV cache ({kv_bytes / GiB:.2f} GiB, {how}) holds about {fits} tokens, "
            f"less than max_num_seqs x max_model_len = {seqs} x {max_len} = "
            f"{int(seqs) * int(max_len)} ({need / GiB:.2f} GiB at {per_token} bytes per token): "
            "vLLM queues or preempts sequences beyond that. Raise kv_cache_gb, or lower "
            "max_num_seqs or max_model_len",
            KVCacheTooSmallWarning,
            stacklevel=4,
        )
