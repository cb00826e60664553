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

import contextlib
import gc
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

from ..checkpoint import CheckpointError, CheckpointReader
from ..direct import READBACK_MODES, DirectReloadError
from ._client import EngineCoreDeadError, core_dead, dead_message, engine_resources, watched_call
from ._client import shutdown as shutdown_engine
from .lifeline import FRONTEND_ENV
from .plugin import BRIDGE_KEY, CPU_LINEAR_MODES, PLUGINS_ENV, run_engine_plugins
from .results import PushReport, PushResult, describe, raise_for_errors

__all__ = [
    "ColocatedEngine",
    "EngineCoreDeadError",
    "EngineUndefinedError",
    "PushReport",
    "ReloadMode",
]

ReloadMode = Literal["direct", "layerwise", "auto"]
WORKER_EXTENSION = "weight_bridge.vllm.worker.WeightBridgeWorkerExtension"
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
        self.checkpoint: str | None = None
        self._served_fd: int | None = None  # open on self.checkpoint (a file) for a rollback
        self._undefined: str | None = None
        self._lock = threading.RLock()
        extra = dict(llm_kwargs.pop("additional_config", None) or {})
        extra[BRIDGE_KEY] = {"cpu_linear": cpu_linear}
        llm_kwargs["worker_extension_cls"] = _worker_extension(
            llm_kwargs.get("worker_extension_cls")
        )
        llm_kwargs = colocated_llm_kwargs(self.model, llm_kwargs, kv_cache_gb)
        started = time.perf_counter()
        with _engine_environment(plugins):
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
        ``verify_hash`` and ``check_finite`` default to the engine's settings.
        """
        path = str(Path(checkpoint).resolve())
        # Every header (and shard index) is checked here first, so a broken file is refused in
        # the caller's process with its own error type; each worker checks its mapping again.
        with CheckpointReader(path) as reader:
            where = {name: reader.file_of(name) for name in reader.specs()}
        verify = self.verify_hash if verify_hash is None else verify_hash
        finite = self.check_finite if check_finite is None else check_finite
        with self._lock:
            was_defined = self._undefined is None
            try:
                return self._push(path, version, verify, finite, where)
            except (DirectReloadError, CheckpointError) as exc:
                if self._undefined is None or not was_defined or not self.rollback:
                    raise
                raise self._roll_back(exc) from exc

    def _push(self, path: str, version: Any, verify: bool, finite: bool, where: dict) -> PushReport:
        method = "weight_bridge_push"
        started = time.perf_counter()
        try:
            raw = self._rpc(method, (path, finite, verify, self.reload_mode, self.readback))
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
        self.checkpoint = path
        self._hold(path)
        first = results[0]
        reports = [r.report for r in results]
        report = PushReport(
            checkpoint=path,
            version=version,
            mode=first.mode,
            reason=describe(first.report),
            tensors=first.report.tensors,
            bytes=first.report.bytes,
            direct=first.report.direct,
            refreshed=first.report.refreshed,
            reprocessed=first.report.reprocessed,
            verified_writes=sum(r.verified_writes for r in reports),
            read_s=max(r.preflight_s for r in reports),
            write_s=max(r.write_s for r in reports),
            refresh_s=max(r.refresh_s for r in reports),
            readback_s=max(r.readback_s for r in reports),
            relocations=[
                {**asdict(rel), "rank": r.rank} for r in results for rel in r.report.relocations
            ],
            workers=len(results),
        )
        report.elapsed_s = time.perf_counter() - started
        return report

    def _roll_back(self, failure: Exception) -> Exception:
        """Re-write the last version served completely; the error to raise for ``failure``."""
        served = target = self.checkpoint or self.model
        if self._served_fd is not None and not os.path.exists(served):
            # deleted since it was pushed: its bytes live on behind the descriptor we hold
            target = f"/proc/{os.getpid()}/fd/{self._served_fd}"
        version = self.version
        started = time.perf_counter()
        try:
            with CheckpointReader(target) as reader:
                where = {name: reader.file_of(name) for name in reader.specs()}
            self._push(target, version, False, False, where)
        except Exception as again:
            self._undefined = (
                f"{self._undefined}; rolling back to version {version!r} ({target}) failed too: "
                f"{type(again).__name__}: {again}"
            )
            return _amended(failure, f"rolling back to version {version!r} failed: {again}")
        self.checkpoint = served  # the name it was pushed under (its descriptor is held anew)
        self.last_rollback_s = time.perf_counter() - started
        return _amended(
            failure,
            f"the push failed after writing started; the engine rolled back to version "
            f"{version!r} ({target}) in {self.last_rollback_s:.2f} s and serves it",
        )

    def _hold(self, path: str | None) -> None:
        """Keep a descriptor open on the served checkpoint file, so that a rollback can re-read
        it even if something deleted it meanwhile (a directory of shards is re-read by path)."""
        if self._served_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._served_fd)
            self._served_fd = None
        if path is not None and os.path.isfile(path):
            self._served_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)

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
        self._hold(None)
        del llm
        gc.collect()

    def __enter__(self) -> ColocatedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def _engine_environment(plugins: Sequence[str]) -> Iterator[None]:
    """The environment the engine processes started inside this block inherit: ``plugins``
    (run here too, and in no other engine) and this process's id, which the engine core
    watches so that it does not outlive this process (:mod:`weight_bridge.vllm.lifeline`)."""
    values = {FRONTEND_ENV: str(os.getpid())}
    if plugins:
        before = os.environ.get(PLUGINS_ENV)
        values[PLUGINS_ENV] = ",".join([*filter(None, (before or "").split(",")), *plugins])
        run_engine_plugins(values[PLUGINS_ENV])
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _worker_extension(requested: str | None) -> str:
    """The bridge's worker extension, or the user's if it extends the bridge's.

    vLLM mixes exactly one extension class into its workers; one that does not subclass the
    bridge's would silently drop the bridge's methods, so it is refused with the way out.
    """
    if requested is None or requested == WORKER_EXTENSION:
        return WORKER_EXTENSION
    import importlib

    from .worker import WeightBridgeWorkerExtension

    module, _, name = requested.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, WeightBridgeWorkerExtension)):
        raise ValueError(
            f"worker_extension_cls={requested!r} would replace the bridge's worker methods: "
            f"make it a subclass of {WORKER_EXTENSION} (both sets of methods are then available)"
        )
    return requested


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
