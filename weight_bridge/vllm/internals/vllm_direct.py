"""vLLM's own direct reload (0.34+: ``model_executor/model_loader/reload/direct.py``), driven by
the bridge's ``vllm-direct`` reload mode (site 20 of the checklist in
:mod:`weight_bridge.vllm.internals`).

vLLM records each tensor's checkpoint layout before post-load processing, ``begin`` views the
re-laid-out tensors back onto their storages, the model's loaders write in place, and ``finish``
re-runs post-load processing (addresses kept). It has no rollback, does not check that an update
delivers what ``finish`` needs, and says the model must not run in between: the bridge adds those
around it. vLLM turns it on for ``reload_weights`` with ``VLLM_RELOAD_MODE=direct``; the bridge
calls the same functions itself, so a bridged engine rides it without changing how the rest of
the process reloads. vLLM 0.32 has none of it: :func:`vllm_direct_missing` says so.
"""

from __future__ import annotations

from typing import Any
from weakref import WeakKeyDictionary

_DIRECT = "vllm.model_executor.model_loader.reload.direct"
_not_recorded: WeakKeyDictionary[Any, str] = WeakKeyDictionary()  # model -> why vLLM refused

#: The functions of vLLM's ``reload.direct`` the bridge calls (checked per version).
VLLM_DIRECT_SITES = (
    "record_checkpoint_layout",
    "begin_direct_reload",
    "finish_direct_reload",
    "_check_params_kept",
    "_checkpoint_views",
)


def _direct() -> Any:
    import importlib

    return importlib.import_module(_DIRECT)


def vllm_direct_missing() -> str | None:
    """Why this vLLM cannot reload directly itself (None: it can)."""
    try:
        module = _direct()
    except ModuleNotFoundError:
        import vllm

        return f"vLLM {vllm.__version__} has no direct reload of its own (it came in 0.34)"
    missing = [name for name in VLLM_DIRECT_SITES if not hasattr(module, name)]
    return f"{_DIRECT} lacks {missing}" if missing else None


def record_vllm_layout(model: Any) -> None:
    """At load, before post-load processing: vLLM's own record of every tensor's checkpoint
    layout (what its direct reload views back to), where vLLM has one. Once per model. A model
    vLLM's direct reload does not support (online quantization...) still loads; its refusal
    is kept for :func:`vllm_direct_refusal`."""
    if vllm_direct_missing() is None:
        try:
            _direct().record_checkpoint_layout(model)
        except RuntimeError as exc:
            _not_recorded[model] = str(exc)


def vllm_direct_refusal(model: Any) -> str | None:
    """What vLLM's ``begin`` would refuse this model for (None: it would begin), found by
    running its own checks, which change nothing."""
    missing = vllm_direct_missing()
    if missing is not None:
        return missing
    direct = _direct()
    if not hasattr(model, "_ckpt_param_names"):
        why = _not_recorded.get(model, "the engine was not started by the bridge")
        return f"vLLM recorded no checkpoint layout for this model at load: {why}"
    try:
        direct._check_params_kept(model)
        direct._checkpoint_views(model)
    except RuntimeError as exc:
        return str(exc)
    return None


def vllm_direct_begin(model: Any) -> None:
    """vLLM's ``begin``: re-laid-out tensors viewed back to their checkpoint layout; from here
    the model holds checkpoint-layout bytes until :func:`vllm_direct_finish`."""
    _direct().begin_direct_reload(model)


def vllm_direct_finish(model: Any, model_config: Any, device: Any) -> None:
    """vLLM's ``finish``: post-load processing re-run (addresses kept, derived state refilled)."""
    _direct().finish_direct_reload(model, model_config, device)
