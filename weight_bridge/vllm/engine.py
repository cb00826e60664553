"""``ColocatedEngine``: a vLLM engine in this job that always serves the last pushed policy."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..checkpoint import resolve_checkpoint_files
from .plugin import BRIDGE_KEY, CPU_LINEAR_MODES

__all__ = ["ColocatedEngine", "EngineUndefinedError", "PushReport", "ReloadMode"]

ReloadMode = Literal["direct", "layerwise", "auto"]
WORKER_EXTENSION = "weight_bridge.vllm.worker.WeightBridgeWorkerExtension"


class EngineUndefinedError(RuntimeError):
    """The engine's weights are half-written; it refuses to generate until a push succeeds."""


@dataclass
class PushReport:
    """What one push wrote, how, and how long it took (seconds; the slowest worker's)."""

    checkpoint: str
    version: Any
    mode: str
    reason: str = ""
    tensors: int = 0
    bytes: int = 0
    read_s: float = 0.0
    write_s: float = 0.0
    elapsed_s: float = 0.0
    relocations: list[dict] = field(default_factory=list)
    workers: int = 1


class ColocatedEngine:
    """A ``vllm.LLM`` started with the bridge wired in, plus push / generate / addresses.

    ``reload_mode``: ``"direct"`` writes every checkpoint tensor into the live storage;
    ``"layerwise"`` uses vLLM's own ``reload_weights``; ``"auto"`` uses direct when every weight
    is directly reloadable and layerwise otherwise (the report says which and why).
    ``cpu_linear`` only matters on the CPU backend (see :mod:`weight_bridge.vllm.plugin`).
    Every other keyword goes to ``vllm.LLM``.
    """

    def __init__(
        self,
        model: str | os.PathLike,
        reload_mode: ReloadMode = "direct",
        cpu_linear: str = "torch",
        check_finite: bool = True,
        verify_hash: bool = False,
        **llm_kwargs: Any,
    ):
        if reload_mode not in ("direct", "layerwise", "auto"):
            raise ValueError(f"reload_mode must be direct, layerwise or auto, not {reload_mode!r}")
        if cpu_linear not in CPU_LINEAR_MODES:
            raise ValueError(f"cpu_linear must be one of {CPU_LINEAR_MODES}, not {cpu_linear!r}")
        from vllm import LLM

        self.model = str(model)
        self.reload_mode: ReloadMode = reload_mode
        self.check_finite = check_finite
        self.verify_hash = verify_hash
        self.version: Any = None
        self.checkpoint: str | None = None
        self._undefined: str | None = None
        self._lock = threading.RLock()
        extra = dict(llm_kwargs.pop("additional_config", None) or {})
        extra[BRIDGE_KEY] = {"cpu_linear": cpu_linear}
        llm_kwargs.setdefault("worker_extension_cls", WORKER_EXTENSION)
        started = time.perf_counter()
        self.llm = LLM(model=self.model, additional_config=extra, **llm_kwargs)
        self.startup_s = time.perf_counter() - started

    # -- weights -----------------------------------------------------------------------------

    def push(
        self,
        checkpoint: str | os.PathLike,
        version: Any = None,
        verify_hash: bool | None = None,
    ) -> PushReport:
        """Write ``checkpoint`` (a safetensors file or a directory of shards) into the engine.

        Rejections (bad names, shapes, dtypes, NaN/Inf, a corrupt or torn file) raise before
        anything is written and leave the engine serving the previous version. A failure after
        writing started leaves the engine undefined: it refuses to generate until a complete
        push succeeds.
        """
        path = str(Path(checkpoint).resolve())
        resolve_checkpoint_files(path)  # fail fast on a missing file / escaping index
        verify = self.verify_hash if verify_hash is None else verify_hash
        with self._lock:
            started = time.perf_counter()
            mode, reason = self._choose_mode()
            method = "weight_bridge_push" if mode == "direct" else "weight_bridge_layerwise"
            try:
                results = self.llm.collective_rpc(method, args=(path, self.check_finite, verify))
            except BaseException as exc:
                self._after_failure(exc)
                raise
            self.llm.reset_prefix_cache()
            self._undefined = None
            self.version = version
            self.checkpoint = path
            report = PushReport(
                checkpoint=path,
                version=version,
                mode=mode,
                reason=reason,
                tensors=results[0].get("tensors", 0),
                bytes=results[0].get("bytes", 0),
                read_s=max(r.get("preflight_s", 0.0) for r in results),
                write_s=max(r.get("write_s", 0.0) for r in results),
                relocations=results[0].get("relocations", []),
                workers=len(results),
            )
            report.elapsed_s = time.perf_counter() - started
            return report

    def _choose_mode(self) -> tuple[str, str]:
        if self.reload_mode != "auto":
            return self.reload_mode, "requested"
        problems: dict[str, str] = {}
        for plan in self.llm.collective_rpc("weight_bridge_plan"):
            problems.update(plan.get("problems", {}))
        if not problems:
            return "direct", "every weight is directly reloadable"
        first = sorted(problems.items())[:3]
        detail = "; ".join(f"{n}: {why}" for n, why in first)
        return "layerwise", f"{len(problems)} weights not directly reloadable ({detail})"

    def _after_failure(self, exc: BaseException) -> None:
        try:
            reasons = [r for r in self.llm.collective_rpc("weight_bridge_undefined") if r]
        except Exception as probe:  # the workers cannot even answer: assume the worst
            reasons = [f"workers unreachable after a failed push ({probe})"]
        if reasons:
            self._undefined = reasons[0]

    def plan(self) -> list[dict]:
        """Per worker, a dry run of a direct reload: targets, relocations and refusals."""
        return self.llm.collective_rpc("weight_bridge_plan")

    def addresses(self) -> list[dict[str, tuple]]:
        """Per worker, every parameter/buffer name -> (data_ptr, shape, stride, dtype)."""
        return self.llm.collective_rpc("weight_bridge_addresses")

    @property
    def undefined(self) -> str | None:
        """Why the engine refuses to generate (a push failed mid-way), or None."""
        return self._undefined

    # -- generation --------------------------------------------------------------------------

    def generate(self, prompts: Any, sampling_params: Any = None, **kwargs: Any) -> list[Any]:
        """``vllm.LLM.generate``; each output gets ``policy_version``, the version it used."""
        with self._lock:
            if self._undefined is not None:
                raise EngineUndefinedError(
                    f"engine weights are undefined ({self._undefined}); push a complete "
                    "checkpoint before generating"
                )
            kwargs.setdefault("use_tqdm", False)
            outputs = self.llm.generate(prompts, sampling_params, **kwargs)
            for out in outputs:
                vars(out)["policy_version"] = self.version
            return outputs

    # -- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Shut the engine and its worker processes down."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None  # type: ignore[assignment]
        engine = getattr(llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        shutdown = getattr(core, "shutdown", None)
        if callable(shutdown):
            shutdown()
        del llm
        import gc

        gc.collect()

    def __enter__(self) -> ColocatedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def token_prompts(token_ids: Sequence[Sequence[int]]) -> list[dict]:
    """Prompts given as token ids (sidesteps the tokenizer in tests and toy tasks)."""
    return [{"prompt_token_ids": list(ids)} for ids in token_ids]
