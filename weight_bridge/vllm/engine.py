"""``ColocatedEngine``: a vLLM engine in this job that always serves the last pushed policy.

What a failed push leaves behind:

* A checkpoint that does not fit (names, shapes, dtypes, NaN/Inf, a corrupt, truncated, foreign
  or torn file, a shard index that leads out of its directory, weights the reload mode cannot
  prove or refresh) is refused before the first byte is written; the engine keeps serving the
  previous version. The error (:class:`DirectReloadError` or :class:`CheckpointError`, the
  same in-process and multi-process) names the checkpoint, the file and the tensor where there
  is one, and the problem.
* A failure after writing started (in a weight loader, in the refresh of derived state, in the
  read-back, in the prefix-cache reset) is rolled back: the engine re-writes the last version it
  served completely from that version's checkpoint and keeps serving it; the error says so
  (``rollback=False`` turns this off). Only if the rollback fails too is the engine left
  *undefined*: :meth:`ColocatedEngine.generate` raises :class:`EngineUndefinedError` naming
  why, until a complete push succeeds.
* With a multi-process engine (vLLM's default), every call into the workers waits at most
  ``rpc_timeout_s`` and stops waiting as soon as vLLM marks the engine core process dead
  (:class:`EngineCoreDeadError`): a worker that dies or hangs mid-push is an error within a
  bounded time, never a hang. ``generate`` is watched the same way, without the timeout. An
  in-process engine runs the call on the caller's thread: it cannot be bounded.

Concurrency: every push, generate and worker call holds one re-entrant lock, so calls from
several threads run one at a time and each generate call is served by exactly one version.
``ColocatedEngine.llm`` (the ``vllm.LLM``) bypasses both the lock and the undefined check: use
it only for what the bridge does not offer, never concurrently with a push.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from ..checkpoint import BASE_VERSION_KEY, CheckpointError, CheckpointReader
from ..direct import READBACK_MODES, DirectReloadError
from ._client import EngineCoreDeadError, core_dead, dead_message, engine_resources, watched_call
from ._client import shutdown as shutdown_engine
from .launch import engine_environment, worker_extension
from .plugin import BRIDGE_KEY, CPU_LINEAR_MODES
from .results import PushReport, PushResult, raise_for_errors
from .served import ServedCheckpoint, hold

__all__ = [
    "ColocatedEngine",
    "EngineCoreDeadError",
    "EngineUndefinedError",
    "PushReport",
    "ReloadMode",
]

ReloadMode = Literal["direct", "layerwise", "auto"]
_PROBE_TIMEOUT_S = 30.0  # the most the post-failure "are you undefined?" probe may wait
_DEFAULT: Any = object()


class EngineUndefinedError(RuntimeError):
    """The engine's weights are half-written; it refuses to generate until a push succeeds."""


class ColocatedEngine:
    """A ``vllm.LLM`` started with the bridge wired in, plus push / generate / addresses.

    ``reload_mode``: ``"direct"`` writes every checkpoint tensor into the live storage and
    refreshes the derived state the bridge knows (refusing, before writing, any weight it cannot
    prove or refresh); ``"auto"`` does the same and hands only the modules it cannot write
    directly to vLLM's own per-layer processing (whole-model ``reload_weights`` only when no
    weight can be written directly); ``"layerwise"`` always uses vLLM's ``reload_weights``. The
    push report says which weights went which way and why. ``readback`` (``"sampled"``,
    ``"full"``, ``"off"``) reads every write back after a push and compares it with the
    checkpoint.
    ``cpu_linear`` only matters on the CPU backend (see :mod:`weight_bridge.vllm.plugin`).
    ``check_finite`` refuses checkpoints holding NaN/Inf; ``verify_hash`` checks the content hash
    written by :func:`~weight_bridge.checkpoint.save_checkpoint` (both overridable per push).
    ``rollback`` (default on) re-writes the previous version after a push that failed
    after writing started (``last_rollback_s`` says how long it took), from its checkpoint
    file, on which the engine holds a descriptor: a served file deleted meanwhile still rolls
    back.
    ``worker_extension_cls`` may name a subclass of the bridge's worker extension (your own
    worker methods beside the bridge's); anything else is refused.
    ``rpc_timeout_s`` bounds every call into the workers (``None``: wait indefinitely); it is
    passed to ``collective_rpc(timeout=...)`` and, for a multi-process engine, also enforced on
    this side. ``kv_cache_gb``: the engine's KV cache per worker in GiB, on every backend; left
    unset, colocated defaults leave room for the trainer (1 GiB on CPU, ``gpu_memory_utilization``
    0.3 on CUDA; explicit vLLM settings win: :mod:`weight_bridge.vllm.memory`). Every other
    keyword goes to ``vllm.LLM``.
    """

    def __init__(
        self,
        model: str | os.PathLike,
        reload_mode: ReloadMode = "direct",
        cpu_linear: str = "repack",
        check_finite: bool = True,
        verify_hash: bool = False,
        rpc_timeout_s: float | None = 300,
        readback: str = "sampled",
        rollback: bool = True,
        plugins: Sequence[str] = (),
        kv_cache_gb: float | None = None,
        **llm_kwargs: Any,
    ):
        if reload_mode not in ("direct", "layerwise", "auto"):
            raise ValueError(f"reload_mode must be direct, layerwise or auto, not {reload_mode!r}")
        if readback not in READBACK_MODES:
            raise ValueError(f"readback must be one of {READBACK_MODES}, not {readback!r}")
        if cpu_linear not in CPU_LINEAR_MODES:
            raise ValueError(f"cpu_linear must be one of {CPU_LINEAR_MODES}, not {cpu_linear!r}")
        if rpc_timeout_s is not None and not rpc_timeout_s > 0:
            raise ValueError(f"rpc_timeout_s must be positive or None, not {rpc_timeout_s!r}")
        from vllm import LLM

        from .memory import colocated_llm_kwargs

        self.model = str(model)
        self.reload_mode: ReloadMode = reload_mode
        self.check_finite = check_finite
        self.readback = readback
        self.rollback = rollback
        self.last_rollback_s: float | None = None
        self.verify_hash = verify_hash
        self.rpc_timeout_s = rpc_timeout_s
        self.version: Any = None
        # what the served version is made of: a complete checkpoint, then partials on top of it
        self._served: list[ServedCheckpoint] = []
        self._undefined: str | None = None
        self._lock = threading.RLock()
        extra = dict(llm_kwargs.pop("additional_config", None) or {})
        extra[BRIDGE_KEY] = {"cpu_linear": cpu_linear}
        llm_kwargs["worker_extension_cls"] = worker_extension(
            llm_kwargs.get("worker_extension_cls")
        )
        llm_kwargs = colocated_llm_kwargs(self.model, llm_kwargs, kv_cache_gb)
        started = time.perf_counter()
        with engine_environment(plugins):
            self.llm = LLM(model=self.model, additional_config=extra, **llm_kwargs)
        self.startup_s = time.perf_counter() - started

    # -- weights -----------------------------------------------------------------------------

    def push(
        self,
        checkpoint: str | os.PathLike,
        version: Any = None,
        verify_hash: bool | None = None,
        check_finite: bool | None = None,
    ) -> PushReport:
        """Write ``checkpoint`` (a safetensors file or a directory of shards) into the engine.

        Rejections (bad names, shapes, dtypes, NaN/Inf, a corrupt or torn file, weights the
        reload mode cannot prove or refresh) raise :class:`DirectReloadError` or
        :class:`CheckpointError` before anything is written; the engine keeps serving the
        previous version. A failure after writing started is rolled back to the previous
        version (see the module docstring); the error raised says whether that worked.
        ``version`` (what outputs report as ``policy_version``) defaults to the ``version``
        entry of the checkpoint's metadata. ``verify_hash`` and ``check_finite`` default to the
        engine's settings.

        A *partial* checkpoint (metadata ``base_version``, see
        :data:`~weight_bridge.checkpoint.BASE_VERSION_KEY`) holds a subset of the tensors and is
        written only when the engine serves exactly that base version; otherwise it is refused,
        naming both versions, before anything is written. It is written directly (never by
        vLLM's layerwise path), and only the modules it writes into are refreshed. A complete
        checkpoint is a valid base at any time.
        """
        path = str(Path(checkpoint).resolve())
        # Every header (and shard index) is checked here first, so a broken file is refused in
        # the caller's process with its own error type; each worker checks its mapping again.
        with CheckpointReader(path) as reader:
            where = {name: reader.file_of(name) for name in reader.specs()}
            base = reader.metadata.get(BASE_VERSION_KEY)
            if version is None:
                version = reader.metadata.get("version")
        verify = self.verify_hash if verify_hash is None else verify_hash
        finite = self.check_finite if check_finite is None else check_finite
        with self._lock:
            if base is not None:
                self._check_base(path, base)
            was_defined = self._undefined is None
            try:
                report = self._push(path, version, verify, finite, where, base is not None)
            except (DirectReloadError, CheckpointError) as exc:
                if self._undefined is None or not was_defined or not self.rollback:
                    raise
                raise self._roll_back(exc) from exc
            self._serve(path, version, partial=base is not None)
            return report

    @property
    def checkpoint(self) -> str | None:
        """The checkpoint pushed last (after partial pushes, the last partial one; the whole
        chain is :attr:`served_checkpoints`)."""
        return self._served[-1].path if self._served else None

    @property
    def served_checkpoints(self) -> list[str]:
        """What the served version is made of: its full checkpoint, then each partial one pushed
        on top of it, in order (all needed to roll back to it; empty before the first push)."""
        return [link.path for link in self._served]

    def _check_base(self, path: str, base: str) -> None:
        """A partial checkpoint applies on top of exactly its base version, or not at all."""
        if self._undefined is not None:
            served = f"no version: its weights are undefined ({self._undefined})"
        elif not self._served or str(self.version) != base:
            served = f"version {self.version!r}" if self._served else "the weights it started with"
        else:
            return
        raise DirectReloadError(
            f"partial checkpoint {path} applies on top of version {base!r}, but the engine serves "
            f"{served}; push a complete checkpoint (nothing was written)"
        )

    def _push(
        self, path: str, version: Any, verify: bool, finite: bool, where: dict, partial: bool
    ) -> PushReport:
        method = "weight_bridge_push"
        started = time.perf_counter()
        args = (path, finite, verify, self.reload_mode, self.readback, partial)
        try:
            raw = self._rpc(method, args)
            results = [PushResult.from_dict(r) for r in raw]
        except BaseException as exc:
            self._after_failure(exc, method)
            if self._core_dead() and not isinstance(exc, EngineCoreDeadError):
                raise EngineCoreDeadError(self._undefined or str(exc)) from exc
            raise
        undefined = next((r.undefined for r in results if r.undefined), None)
        if undefined is not None:
            self._undefined = undefined
        raise_for_errors(results, path, where)
        try:
            self._rpc_plain(lambda llm: llm.reset_prefix_cache())
        except Exception as exc:
            self._undefined = (
                f"prefix cache reset failed after the push of {path} "
                f"({type(exc).__name__}: {exc}); its cached KV may be from the old weights"
            )
            raise DirectReloadError(self._undefined) from exc
        self._undefined = None
        self.version = version
        report = PushReport.merged(results, path, version, partial)
        report.elapsed_s = time.perf_counter() - started
        return report

    def _roll_back(self, failure: Exception) -> Exception:
        """Re-write the last version served completely (its full checkpoint, then each partial
        one on top of it); the error to raise for ``failure``."""
        chain = self._served or [ServedCheckpoint(self.model, self.version)]
        version = self.version
        started = time.perf_counter()
        try:
            for i, link in enumerate(chain):
                target = link.readable()
                with CheckpointReader(target) as reader:
                    where = {name: reader.file_of(name) for name in reader.specs()}
                self._push(target, link.version, False, False, where, partial=i > 0)
        except Exception as again:
            self._undefined = (
                f"{self._undefined}; rolling back to version {version!r} ({chain[-1].path}) "
                f"failed too: {type(again).__name__}: {again}"
            )
            return _amended(failure, f"rolling back to version {version!r} failed: {again}")
        self.last_rollback_s = time.perf_counter() - started
        return _amended(
            failure,
            f"the push failed after writing started; the engine rolled back to version "
            f"{version!r} ({chain[-1].path}) in {self.last_rollback_s:.2f} s and serves it",
        )

    def _serve(self, path: str, version: Any, partial: bool) -> None:
        """Record ``path`` as (the last part of) what the engine serves."""
        if not partial:
            for link in self._served:
                link.release()
            self._served = []
        self._served.append(ServedCheckpoint(path, version, hold(path)))

    def _after_failure(self, exc: BaseException, what: str) -> None:
        if isinstance(exc, (EngineCoreDeadError, TimeoutError)):
            # A dead core cannot answer; a stuck one would answer after the stuck call, if ever.
            self._undefined = f"{type(exc).__name__}: {exc}"
            return
        if not isinstance(exc, Exception):
            # Interrupted here (KeyboardInterrupt...): a multi-process engine may still finish
            # the push after this, so neither the old version nor the new one can be claimed.
            self._undefined = f"{what} interrupted by {type(exc).__name__}; weights unknown"
            return
        if self._core_dead():
            # vLLM may report a worker's death as a plain failure of the call, just before it
            # notices that the engine core is gone.
            why = dead_message(engine_resources(self.llm), what)
            self._undefined = f"{why} ({type(exc).__name__}: {exc})"
            return
        try:
            timeout = min(self.rpc_timeout_s or _PROBE_TIMEOUT_S, _PROBE_TIMEOUT_S)
            reasons = [r for r in self._rpc("weight_bridge_undefined", timeout=timeout) if r]
        except Exception as probe:  # the workers cannot even answer: assume the worst
            reasons = [f"workers unreachable after a failed push ({type(probe).__name__}: {probe})"]
        if reasons:
            self._undefined = reasons[0]

    def plan(self, mode: str | None = None) -> list[dict]:
        """Per worker, a dry run of a push in ``mode`` (default the engine's): per weight its
        write target (relocation, refresh), the modules re-processed, and the refusals."""
        with self._lock:
            return self._rpc("weight_bridge_plan", (mode or self.reload_mode,))

    def addresses(self) -> list[dict[str, tuple]]:
        """Per worker, every parameter/buffer name -> (data_ptr, shape, stride, dtype)."""
        with self._lock:
            return self._rpc("weight_bridge_addresses")

    @property
    def undefined(self) -> str | None:
        """Why the engine refuses to generate (a push failed mid-way), or None."""
        return self._undefined

    # -- calls into the workers --------------------------------------------------------------

    def _core_dead(self, grace_s: float = 2.0) -> bool:
        return core_dead(self.llm, grace_s)

    def _rpc(self, method: Any, args: tuple = (), timeout: float | None = _DEFAULT) -> list:
        """``collective_rpc`` bounded by ``timeout`` and by the engine core staying alive."""
        timeout = self.rpc_timeout_s if timeout is _DEFAULT else timeout
        what = method if isinstance(method, str) else getattr(method, "__name__", "call")
        return self._rpc_plain(
            lambda llm: llm.collective_rpc(method, timeout=timeout, args=args), what, timeout
        )

    def _rpc_plain(self, call: Any, what: str = "reset_prefix_cache", timeout: Any = _DEFAULT):
        timeout = self.rpc_timeout_s if timeout is _DEFAULT else timeout
        if self.llm is None:
            raise RuntimeError("the engine is closed")
        return watched_call(self.llm, call, what, timeout)

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
            try:
                outputs = self._rpc_plain(
                    lambda llm: llm.generate(prompts, sampling_params, **kwargs), "generate", None
                )
            except EngineCoreDeadError as exc:
                self._undefined = str(exc)
                raise
            for out in outputs:
                vars(out)["policy_version"] = self.version
            return outputs

    # -- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Shut the engine and its worker processes down.

        Waits up to ``rpc_timeout_s`` (at most 60 s) for a call in another thread to finish,
        then shuts down regardless (a call stuck in a worker then fails).
        """
        wait = min(self.rpc_timeout_s or 60.0, 60.0) if hasattr(self, "rpc_timeout_s") else 60.0
        locked = self._lock.acquire(timeout=wait) if hasattr(self, "_lock") else False
        try:
            llm = getattr(self, "llm", None)
            if llm is None:
                return
            self.llm = None  # type: ignore[assignment]
        finally:
            if locked:
                self._lock.release()
        shutdown_engine(llm)
        for link in getattr(self, "_served", ()):
            link.release()
        del llm
        gc.collect()

    def __enter__(self) -> ColocatedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _amended(error: Exception, note: str) -> Exception:
    """``error`` again (same type, problems kept), its message followed by ``note``."""
    if isinstance(error, DirectReloadError):
        return DirectReloadError(f"{error.summary}; {note}", error.problems)
    if isinstance(error, CheckpointError):
        return CheckpointError(error.path, f"{error.problem}; {note}", error.tensor)
    return error


def token_prompts(token_ids: Sequence[Sequence[int]]) -> list[dict]:
    """Prompts given as token ids (sidesteps the tokenizer in tests and toy tasks)."""
    return [{"prompt_token_ids": list(ids)} for ids in token_ids]
