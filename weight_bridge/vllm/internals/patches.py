"""Every patch of vLLM (sites 1 to 10 of the checklist in :mod:`weight_bridge.vllm.internals`):
the only code of the project that assigns onto a vLLM class, module or layer.

Each ``patch_*`` takes wrapper factories (the original -> what replaces it) from the module that
owns the logic, checks every site it patches before patching any (a ``RuntimeError`` names a
missing one), and patches once per process.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .versions import CHECKLIST, TESTED_VLLM

Wrap = Callable[[Any], Any]  # a wrapper factory: the original -> what replaces it

_LOADER = "vllm.model_executor.model_loader"
_DEFAULT_LOADER = f"{_LOADER}.default_loader.DefaultModelLoader"
_CORE = "vllm.v1.engine.core"
_OFFLINE = "vllm.entrypoints.rl.offline.RLOfflineMixin"
_ASYNC = "vllm.v1.engine.async_llm.AsyncLLM"
_GEMM = "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm"
_MOE = "vllm.model_executor.layers.fused_moe.experts.cpu_moe.CPUUnquantizedExperts"
_PROCESS = "process_weights_after_loading"
_QUEUE_WAIT = "vllm.distributed.device_communicators.shm_broadcast.SpinCondition.wait"
_CPU_DIST_INIT = "vllm.v1.worker.cpu_worker.init_worker_distributed_environment"
_LORA_RESET = "vllm.v1.worker.lora_model_runner_mixin.LoRAModelRunnerMixin.reset_lora_state"
_TOKEN_LABELS = "vllm.v1.engine.output_processor.RequestState.track_weight_version"
_ONLINE_FP8 = "vllm.model_executor.layers.quantization.online.fp8"
#: the online FP8 linear methods whose quantization a push re-runs (site 23)
ONLINE_FP8_LINEAR = ("Fp8PerTensorOnlineLinearMethod", "Fp8PtpcOnlineLinearMethod")

#: Every vLLM module or class attribute replaced by a ``patch_*`` function.
PATCHED = (
    f"{_DEFAULT_LOADER}.get_all_weights",
    f"{_DEFAULT_LOADER}.load_weights",
    f"{_LOADER}.base_loader.{_PROCESS}",
    f"{_CORE}.EngineCore.collective_rpc",
    f"{_CORE}.EngineCore.set_weight_version",
    f"{_CORE}.EngineCore.resume_scheduler",
    f"{_CORE}.DPEngineCoreProc.resume_scheduler",
    f"{_OFFLINE}.update_weights",
    f"{_OFFLINE}.start_weight_update",
    f"{_ASYNC}.update_weights",
    f"{_ASYNC}.start_weight_update",
    _GEMM,
    f"{_MOE}.{_PROCESS}",
    _QUEUE_WAIT,
    _CPU_DIST_INIT,
    _LORA_RESET,
    *(f"{_ONLINE_FP8}.{method}.{_PROCESS}" for method in ONLINE_FP8_LINEAR),
)

_patched: set[str] = set()


def _missing(path: str) -> RuntimeError:
    return RuntimeError(
        f"{path} is missing: weight-bridge supports vLLM {' and '.join(TESTED_VLLM)} "
        f"(see {CHECKLIST}'s checklist)"
    )


def _site(path: str) -> tuple[Any, str]:
    """The owner (module or class) of the vLLM site ``path``, and the attribute's name."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:i])
        try:
            owner: Any = importlib.import_module(module)
            break
        except ModuleNotFoundError as exc:  # a class, not a module, or a module vLLM lacks
            if not exc.name or not f"{module}.".startswith(f"{exc.name}."):
                raise
    else:
        raise _missing(path)
    for part in parts[i:-1]:
        owner = getattr(owner, part, None)
        if owner is None:
            raise _missing(path)
    if not hasattr(owner, parts[-1]):
        raise _missing(path)
    return owner, parts[-1]


def _patch(name: str, wraps: dict[str, Wrap]) -> bool:
    """Replace each site (dotted path) by its wrapper of the original, every site checked
    first; once per process for ``name`` (False: done before)."""
    sites = {path: _site(path) for path in wraps}
    if name in _patched:
        return False
    _patched.add(name)
    for path, (owner, attr) in sites.items():
        setattr(owner, attr, wraps[path](getattr(owner, attr)))
    return True


def patch_default_loader(
    get_all_weights: Wrap, load_weights: Wrap, process_weights_after_loading: Wrap
) -> None:
    """Sites 1 and 2: the default loader's streaming and loading, post-load processing."""
    _patch(
        "loader",
        {
            f"{_DEFAULT_LOADER}.get_all_weights": get_all_weights,
            f"{_DEFAULT_LOADER}.load_weights": load_weights,
            f"{_LOADER}.base_loader.{_PROCESS}": process_weights_after_loading,
        },
    )


@contextlib.contextmanager
def processing_watched(modules: Iterable[Any], after: Callable[[Any], None]) -> Iterator[None]:
    """Within the block, each module's own processing step (site 3: its ``quant_method``'s,
    else its own; wrapped on the instance) calls ``after(module)`` once it returned."""
    undo: list = []
    try:
        for module in modules:
            quant = getattr(module, "quant_method", None)
            owner = quant if quant is not None else module
            original = getattr(owner, _PROCESS, None)
            if original is None or _PROCESS in vars(owner):
                continue

            def wrapped(*args, _original=original, _module=module, **kwargs):
                out = _original(*args, **kwargs)
                after(_module)
                return out

            setattr(owner, _PROCESS, wrapped)
            undo.append(owner)
        yield
    finally:
        for owner in undo:
            delattr(owner, _PROCESS)


def patch_engine_core(
    collective_rpc: Wrap,
    set_weight_version: Wrap,
    resume_scheduler: Wrap,
    step: Wrap,
    utilities: dict[str, Callable],
    log_filter: Callable[[logging.LogRecord], bool],
) -> None:
    """Sites 4 to 7 and 13: ``collective_rpc``, ``set_weight_version``, ``resume_scheduler``
    wherever it is defined, both of the core's step functions (``step``,
    ``step_with_batch_queue``: ``step_fn`` is bound to one of them when the core is built, after
    this), the engine-core ``utilities`` (name -> function of the core), a filter on the core's
    log."""
    _site(f"{_CORE}.EngineCore.resume_scheduler")
    _site(f"{_CORE}.EngineCoreProc._handle_client_request")  # how utilities are found
    wraps = {
        f"{_CORE}.EngineCore.collective_rpc": collective_rpc,
        f"{_CORE}.EngineCore.set_weight_version": set_weight_version,
        f"{_CORE}.EngineCore.step": step,
        f"{_CORE}.EngineCore.step_with_batch_queue": step,
    }
    if not _patch("engine core", wraps):
        return
    core = importlib.import_module(_CORE)
    for name, utility in utilities.items():
        setattr(core.EngineCore, name, utility)
    for cls in (core.EngineCore, core.EngineCoreProc, core.DPEngineCoreProc):
        if "resume_scheduler" in vars(cls):
            cls.resume_scheduler = resume_scheduler(vars(cls)["resume_scheduler"])
    logging.getLogger(core.__name__).addFilter(log_filter)


def patch_rl_api(
    update_weights: Wrap,
    update_weights_async: Wrap,
    start_weight_update: Wrap,
    start_weight_update_async: Wrap,
) -> None:
    """Site 8: the offline (``LLM``) and async (``AsyncLLM``) update calls."""
    _patch(
        "rl api",
        {
            f"{_OFFLINE}.update_weights": update_weights,
            f"{_ASYNC}.update_weights": update_weights_async,
            f"{_OFFLINE}.start_weight_update": start_weight_update,
            f"{_ASYNC}.start_weight_update": start_weight_update_async,
        },
    )


def patch_cpu_linear(dispatch: Wrap) -> None:
    """Site 9: the CPU backend's dispatch of a linear layer's kernel."""
    _patch("cpu linear", {_GEMM: dispatch})


def patch_cpu_moe(process: Wrap) -> None:
    """Site 10: the CPU unquantized experts' processing (their prepack)."""
    _patch("cpu moe", {f"{_MOE}.{_PROCESS}": process})


def patch_queue_waits(wait: Wrap) -> None:
    """Site 18: how a reader of vLLM's shared-memory message queues waits for the next
    message (spinning, then asleep)."""
    _patch("queue waits", {_QUEUE_WAIT: wait})


def patch_cpu_dist_init(init: Wrap) -> None:
    """Site 21: how vLLM's CPU worker initialises its distributed state (its shared-memory
    communicators are named after ``VLLM_DIST_IDENT``, set just before)."""
    _patch("cpu distributed init", {_CPU_DIST_INIT: init})


def patch_lora_reset(reset: Wrap) -> None:
    """Site 22: the model runner's ``reset_lora_state``, which vLLM's worker calls at the end
    of every weight update and which drops every adapter (:mod:`.lora`)."""
    _patch("lora reset", {_LORA_RESET: reset})


def patch_online_fp8(process: Wrap) -> None:
    """Site 23: the online FP8 linear methods' ``process_weights_after_loading`` (each
    quantizes its layer's float ``weight`` into FP8 bytes and a ``weight_scale``)."""
    _patch("online fp8", {f"{_ONLINE_FP8}.{m}.{_PROCESS}": process for m in ONLINE_FP8_LINEAR})


def patch_token_labels(track: Wrap) -> None:
    """Site 24: how the front end labels a request's new tokens with the engine's label
    (``RequestState.track_weight_version``); a request sampled with an adapter version the
    bridge pushed is labelled with that version (:mod:`.lora`)."""
    _patch("token labels", {_TOKEN_LABELS: track})


def cpu_linear_of(layer: Any) -> Any:
    """The kernel vLLM's CPU backend computes ``layer`` with (site 9), or None."""
    return getattr(layer, "cpu_linear", None)


def set_cpu_linear(layer: Any, kernel: Callable) -> None:
    setattr(layer, "cpu_linear", kernel)  # noqa: B010 (an nn.Module attribute)


def drop_cpu_linear(layer: Any) -> None:
    layer.__dict__.pop("cpu_linear", None)
