"""``ColocatedEngine``: a vLLM engine in this job that always serves the last pushed policy.

What a failed push leaves behind:

* A checkpoint that does not fit (names, shapes, dtypes, NaN/Inf, a corrupt, truncated, foreign
  or torn file, a shard index that leads out of its directory) is refused before the first
  byte is written; the engine keeps serving the previous version. The error names the
  checkpoint, the file and the tensor where there is one, and the problem.
* A failure after writing started (an exception in a weight loader) leaves the engine
  *undefined*: :meth:`ColocatedEngine.generate` raises :class:`EngineUndefinedError` naming why,
  until a complete push succeeds.
* With a multi-process engine (vLLM's default), every call into the workers waits at most
  ``rpc_timeout_s`` and stops waiting as soon as vLLM marks the engine core process dead
  (:class:`EngineCoreDeadError`): a worker that dies or hangs mid-push is an error within a
  bounded time, never a hang (vLLM 0.32's own client waits forever on a call, or a generate,
  whose engine core died). ``generate`` is watched the same way, without the timeout. An
  in-process engine runs the call on the caller's thread: it cannot be bounded.

Every push, generate and worker call holds one re-entrant lock, so calls from several threads
run one at a time and each generate call is served by exactly one version.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..checkpoint import CheckpointReader
from ..direct import DirectReloadError
from .plugin import BRIDGE_KEY, CPU_LINEAR_MODES

__all__ = [
    "ColocatedEngine",
    "EngineCoreDeadError",
    "EngineUndefinedError",
    "PushReport",
    "ReloadMode",
]

ReloadMode = Literal["direct", "layerwise", "auto"]
WORKER_EXTENSION = "weight_bridge.vllm.worker.WeightBridgeWorkerExtension"
_POLL_S = 0.05  # how often a waiting call looks for a dead engine core
_PROBE_TIMEOUT_S = 30.0  # the most the post-failure "are you undefined?" probe may wait
_DEFAULT: Any = object()


class EngineUndefinedError(RuntimeError):
    """The engine's weights are half-written; it refuses to generate until a push succeeds."""


class EngineCoreDeadError(RuntimeError):
    """vLLM's engine core process died (a worker was killed, say); the engine must be restarted."""


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
    ``check_finite`` refuses checkpoints holding NaN/Inf; ``verify_hash`` checks the content hash
    written by :func:`~weight_bridge.checkpoint.save_checkpoint` (both overridable per push).
    ``rpc_timeout_s`` bounds every call into the workers (``None``: wait indefinitely); it is
    passed to ``collective_rpc(timeout=...)`` and, for a multi-process engine, also enforced on
    this side. Every other keyword goes to ``vllm.LLM``.
    """

    def __init__(
        self,
        model: str | os.PathLike,
        reload_mode: ReloadMode = "direct",
        cpu_linear: str = "repack",
        check_finite: bool = True,
        verify_hash: bool = False,
        rpc_timeout_s: float | None = 300,
        **llm_kwargs: Any,
    ):
        if reload_mode not in ("direct", "layerwise", "auto"):
            raise ValueError(f"reload_mode must be direct, layerwise or auto, not {reload_mode!r}")
        if cpu_linear not in CPU_LINEAR_MODES:
            raise ValueError(f"cpu_linear must be one of {CPU_LINEAR_MODES}, not {cpu_linear!r}")
        if rpc_timeout_s is not None and not rpc_timeout_s > 0:
            raise ValueError(f"rpc_timeout_s must be positive or None, not {rpc_timeout_s!r}")
        from vllm import LLM

        self.model = str(model)
        self.reload_mode: ReloadMode = reload_mode
        self.check_finite = check_finite
        self.verify_hash = verify_hash
        self.rpc_timeout_s = rpc_timeout_s
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
        check_finite: bool | None = None,
    ) -> PushReport:
        """Write ``checkpoint`` (a safetensors file or a directory of shards) into the engine.

        Rejections (bad names, shapes, dtypes, NaN/Inf, a corrupt or torn file) raise before
        anything is written and leave the engine serving the previous version. A failure after
        writing started leaves the engine undefined: it refuses to generate until a complete
        push succeeds. ``verify_hash`` and ``check_finite`` default to the engine's settings.
        """
        path = str(Path(checkpoint).resolve())
        # Every header (and shard index) is checked here first, so a broken file is refused in
        # the caller's process with its own error type; each worker checks its mapping again.
        with CheckpointReader(path) as reader:
            where = {name: reader.file_of(name) for name in reader.specs()}
        verify = self.verify_hash if verify_hash is None else verify_hash
        finite = self.check_finite if check_finite is None else check_finite
        with self._lock:
            started = time.perf_counter()
            method = "weight_bridge_plan"
            try:
                mode, reason = self._choose_mode()
                method = "weight_bridge_push" if mode == "direct" else "weight_bridge_layerwise"
                results = self._rpc(method, (path, finite, verify))
            except DirectReloadError as exc:
                self._after_failure(exc, method)
                raise _naming_files(exc, path, where) from exc
            except BaseException as exc:
                self._after_failure(exc, method)
                if self._core_dead() and not isinstance(exc, EngineCoreDeadError):
                    raise EngineCoreDeadError(self._undefined or str(exc)) from exc
                raise
            self._rpc_plain(lambda llm: llm.reset_prefix_cache())
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
        for plan in self._rpc("weight_bridge_plan"):
            problems.update(plan.get("problems", {}))
        if not problems:
            return "direct", "every weight is directly reloadable"
        first = sorted(problems.items())[:3]
        detail = "; ".join(f"{n}: {why}" for n, why in first)
        return "layerwise", f"{len(problems)} weights not directly reloadable ({detail})"

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
            why = _dead_message(self._resources(), what)
            self._undefined = f"{why} ({type(exc).__name__}: {exc})"
            return
        try:
            timeout = min(self.rpc_timeout_s or _PROBE_TIMEOUT_S, _PROBE_TIMEOUT_S)
            reasons = [r for r in self._rpc("weight_bridge_undefined", timeout=timeout) if r]
        except Exception as probe:  # the workers cannot even answer: assume the worst
            reasons = [f"workers unreachable after a failed push ({type(probe).__name__}: {probe})"]
        if reasons:
            self._undefined = reasons[0]

    def plan(self) -> list[dict]:
        """Per worker, a dry run of a direct reload: targets, relocations and refusals."""
        with self._lock:
            return self._rpc("weight_bridge_plan")

    def addresses(self) -> list[dict[str, tuple]]:
        """Per worker, every parameter/buffer name -> (data_ptr, shape, stride, dtype)."""
        with self._lock:
            return self._rpc("weight_bridge_addresses")

    @property
    def undefined(self) -> str | None:
        """Why the engine refuses to generate (a push failed mid-way), or None."""
        return self._undefined

    # -- calls into the workers --------------------------------------------------------------

    def _resources(self) -> Any:
        """vLLM's multi-process client state (``engine_dead``...), or None if in-process."""
        client = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        resources = getattr(client, "resources", None)
        return resources if hasattr(resources, "engine_dead") else None

    def _core_dead(self, grace_s: float = 2.0) -> bool:
        """Whether vLLM marked the engine core process dead, waiting up to ``grace_s`` for its
        once-a-second monitor once a process has exited; always False for an in-process engine.
        """
        resources = self._resources()
        if resources is None:
            return False
        procs = getattr(getattr(resources, "engine_manager", None), "processes", None) or []
        deadline = time.monotonic() + grace_s
        while not resources.engine_dead:
            if all(p.is_alive() for p in procs) or time.monotonic() > deadline:
                return bool(resources.engine_dead)
            time.sleep(_POLL_S)
        return True

    def _rpc(self, method: Any, args: tuple = (), timeout: float | None = _DEFAULT) -> list:
        """``collective_rpc`` bounded by ``timeout`` and by the engine core staying alive."""
        timeout = self.rpc_timeout_s if timeout is _DEFAULT else timeout
        what = method if isinstance(method, str) else getattr(method, "__name__", "call")
        return self._rpc_plain(
            lambda llm: llm.collective_rpc(method, timeout=timeout, args=args), what, timeout
        )

    def _rpc_plain(self, call: Any, what: str = "reset_prefix_cache", timeout: Any = _DEFAULT):
        """Run ``call(llm)``; for a multi-process engine, from a helper thread, watched."""
        timeout = self.rpc_timeout_s if timeout is _DEFAULT else timeout
        llm = self.llm
        if llm is None:
            raise RuntimeError("the engine is closed")
        resources = self._resources()
        if resources is None:
            return call(llm)  # in-process engine core: the call runs on this thread
        client = llm.llm_engine.engine_core
        if resources.engine_dead:
            raise EngineCoreDeadError(_dead_message(resources, what))
        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["result"] = call(llm)
            except BaseException as exc:
                box["error"] = exc
            finally:
                done.set()

        timed_out = TimeoutError(
            f"{what} did not finish within rpc_timeout_s={timeout} s; the workers may still be "
            "running it (restart the engine, or push again)"
        )
        started = time.monotonic()
        threading.Thread(target=run, name=f"weight-bridge-{what}", daemon=True).start()
        while not done.wait(_POLL_S):
            if resources.engine_dead:
                if done.wait(1.0):
                    break  # it answered (or failed by itself) as the core went: report that
                _fail_pending(client, EngineCoreDeadError(_dead_message(resources, what)))
                raise EngineCoreDeadError(_dead_message(resources, what))
            if timeout is not None and time.monotonic() - started > timeout:
                raise timed_out
        if "error" in box:
            error = box["error"]
            if resources.engine_dead and not isinstance(error, DirectReloadError):
                raise EngineCoreDeadError(_dead_message(resources, what)) from error
            if timeout is not None and type(error) is Exception and "timed out" in str(error):
                # vLLM's executor enforced the same timeout first; its TimeoutError reaches
                # this process as a plain Exception carrying the message.
                raise timed_out from error
            raise error
        return box["result"]

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


def _dead_message(resources: Any, what: str) -> str:
    manager = getattr(resources, "engine_manager", None)
    detail = ""
    finished = getattr(manager, "finished_procs", None)
    if callable(finished):
        try:
            procs = finished()
        except Exception:
            procs = {}
        if procs:
            detail = " (" + ", ".join(f"{n} exit code {c}" for n, c in procs.items()) + ")"
    return (
        f"the vLLM engine core process died during {what}{detail}; "
        "the engine cannot serve again: close it and start a new one"
    )


def _fail_pending(client: Any, error: BaseException) -> None:
    """Fail the calls still waiting on a dead engine core, so their threads end: utility calls
    wait on futures, generate waits on the outputs queue (vLLM raises what it finds there)."""
    for future in list(getattr(client, "utility_results", {}).values()):
        with contextlib.suppress(Exception):
            if not future.done():
                future.set_exception(error)
    outputs = getattr(client, "outputs_queue", None)
    if outputs is not None:
        with contextlib.suppress(Exception):
            outputs.put_nowait(error)


def _naming_files(
    exc: DirectReloadError, checkpoint: str, where: Mapping[str, Path | None]
) -> DirectReloadError:
    """``exc`` with the checkpoint named up front and, per tensor, the shard that holds it."""
    head = str(exc).splitlines()[0] if str(exc) else "direct reload failed"
    if not head.startswith(checkpoint):
        head = f"{checkpoint}: {head}"
    problems = {}
    for name, why in exc.problems.items():
        file = where.get(name)
        problems[name] = (
            f"{why} (in {file})" if file is not None and str(file) != checkpoint else why
        )
    return DirectReloadError(head, problems)


def token_prompts(token_ids: Sequence[Sequence[int]]) -> list[dict]:
    """Prompts given as token ids (sidesteps the tokenizer in tests and toy tasks)."""
    return [{"prompt_token_ids": list(ids)} for ids in token_ids]
