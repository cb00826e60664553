"""``ColocatedEngine``: a ``vllm.LLM`` in this job with the bridge wired in, and a typed push.

It is a convenience over the one push path, vLLM's own RL update API with the
``weight_bridge`` backend (:mod:`.backend`): it starts the engine with the backend, colocated
memory defaults (:mod:`.memory`) and its checkpoint root, and its :meth:`~ColocatedEngine.push`
is ``start_weight_update`` -> ``update_weights`` -> ``finish_weight_update`` under one lock,
with the workers' typed results turned into a :class:`PushReport` or into the project's own
error. What a failed push leaves behind:

* A checkpoint that does not fit (names, shapes, dtypes, NaN/Inf, a corrupt, truncated, foreign
  or torn file, a shard index that leads out of its directory, a path outside the checkpoint
  root, weights the reload mode cannot prove or refresh) is refused before the first byte is
  written on any rank; the engine keeps serving the previous version. The error
  (:class:`DirectReloadError` or :class:`CheckpointError`, the same in-process and
  multi-process) names the checkpoint, the file and the tensor where there is one, and the
  problem.
* A failure after writing started (in a weight loader, in the refresh of derived state, in the
  read-back) is rolled back: every rank re-writes the version it served, from that version's
  checkpoints, and keeps serving it; the error says so (``rollback=False`` turns this off).
  Only if the rollback fails too is the engine left *undefined*: :meth:`generate` raises
  :class:`EngineUndefinedError` naming why, until a complete push succeeds.
* With a multi-process engine (vLLM's default), every call into the engine waits at most
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

import dataclasses
import gc
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..checkpoint import CheckpointError
from ..direct import DirectReloadError
from ._client import EngineCoreDeadError, core_dead, dead_message, engine_resources, watched_call
from ._client import shutdown as shutdown_engine
from .api_hooks import update_results
from .launch import bridged_engine_args, engine_environment, engine_options
from .options import ReloadMode, SessionOptions
from .results import PushReport, PushResult

__all__ = [
    "ColocatedEngine",
    "EngineCoreDeadError",
    "EngineUndefinedError",
    "PushReport",
    "ReloadMode",
    "token_prompts",
]

_PROBE_TIMEOUT_S = 30.0  # the most the post-failure "are you undefined?" probe may wait
_DEFAULT: Any = object()
_LABELS_KEPT = 64  # version labels remembered to map outputs' weight_versions back


class EngineUndefinedError(RuntimeError):
    """The engine's weights are half-written; it refuses to generate until a push succeeds."""


class ColocatedEngine:
    """A ``vllm.LLM`` started with the ``weight_bridge`` backend, plus push / generate / plan.

    ``checkpoint_root``: the directory pushes may read from (default:
    ``$WEIGHT_BRIDGE_CHECKPOINT_ROOT``, else the current directory); a checkpoint outside it is
    refused by name (:mod:`weight_bridge.checkpoint.trust`).
    ``reload_mode``: ``"direct"`` writes every checkpoint tensor into the live storage and
    refreshes the derived state the bridge knows (refusing, before writing, any weight it cannot
    prove or refresh); ``"auto"`` does the same and hands only the modules it cannot write
    directly to vLLM's own per-layer processing (whole-model ``reload_weights`` only when no
    weight can be written directly); ``"layerwise"`` always uses vLLM's ``reload_weights``. The
    push report says which weights went which way and why. ``readback`` (``"sampled"``,
    ``"full"``, ``"off"``) reads every write back after a push and compares it with the
    checkpoint. ``cpu_linear`` only matters on the CPU backend (see
    :mod:`weight_bridge.vllm.refresh`). ``check_finite`` refuses checkpoints holding NaN/Inf;
    ``verify_hash`` checks the content hash written by
    :func:`~weight_bridge.checkpoint.save_checkpoint` (both overridable per push).
    ``rollback`` (default on) re-writes the previous version after a push that failed after
    writing started (``last_rollback_s`` says how long it took), from its checkpoint files, on
    which the workers hold descriptors: a served file deleted meanwhile still rolls back.
    ``worker_extension_cls`` may name a subclass of the bridge's worker extension (your own
    worker methods beside the bridge's); anything else is refused.
    ``rpc_timeout_s`` bounds every call into the engine (``None``: wait indefinitely); for a
    multi-process engine it is enforced on this side. ``kv_cache_gb``: the engine's KV cache
    per worker in GiB, on every backend; left unset, colocated defaults leave room for the
    trainer (1 GiB on CPU, ``gpu_memory_utilization`` 0.3 on CUDA; explicit vLLM settings win:
    :mod:`weight_bridge.vllm.memory`). Every other keyword goes to ``vllm.LLM``.
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
        checkpoint_root: str | os.PathLike | None = None,
        **llm_kwargs: Any,
    ):
        options = engine_options(
            checkpoint_root,
            reload_mode=reload_mode,
            cpu_linear=cpu_linear,
            readback=readback,
            check_finite=check_finite,
            verify_hash=verify_hash,
            rollback=rollback,
        )
        if rpc_timeout_s is not None and not rpc_timeout_s > 0:
            raise ValueError(f"rpc_timeout_s must be positive or None, not {rpc_timeout_s!r}")
        from vllm import LLM

        self.model = str(model)
        self.options = options
        self.rpc_timeout_s = rpc_timeout_s
        self.last_rollback_s: float | None = None
        self.version: Any = None
        self._served: list[str] = []
        self._labels: dict[str, Any] = {}
        self._undefined: str | None = None
        self._lock = threading.RLock()
        kwargs = bridged_engine_args(self.model, options, llm_kwargs, kv_cache_gb)
        started = time.perf_counter()
        with engine_environment(plugins):
            self.llm = LLM(model=self.model, **kwargs)
        self.startup_s = time.perf_counter() - started

    def configure(self, **session: Any) -> None:
        """Change per-update options of the running engine (``reload_mode``, ``readback``,
        ``check_finite``, ``verify_hash``, ``rollback``): vLLM's
        ``init_weight_transfer_engine`` with the bridge's session options."""
        options = dataclasses.replace(self.options, **session)
        chosen = {f.name: getattr(options, f.name) for f in dataclasses.fields(SessionOptions)}
        with self._lock:
            self._call(
                lambda llm: llm.init_weight_transfer_engine({"init_info": chosen}),
                "init_weight_transfer_engine",
            )
            self.options = options

    reload_mode = property(
        lambda self: self.options.reload_mode,
        lambda self, value: self.configure(reload_mode=value),
        doc="How pushes write (direct, auto, layerwise); settable.",
    )
    rollback = property(
        lambda self: self.options.rollback,
        lambda self, value: self.configure(rollback=value),
        doc="Whether a push that failed after writing started is rolled back; settable.",
    )
    check_finite = property(
        lambda self: self.options.check_finite,
        lambda self, value: self.configure(check_finite=value),
        doc="Whether checkpoints holding NaN/Inf are refused; settable.",
    )
    verify_hash = property(
        lambda self: self.options.verify_hash,
        lambda self, value: self.configure(verify_hash=value),
        doc="Whether each push verifies the checkpoint's content hash; settable.",
    )
    readback = property(
        lambda self: self.options.readback,
        lambda self, value: self.configure(readback=value),
        doc="How writes are read back (sampled, full, off); settable.",
    )

    @property
    def checkpoint_root(self) -> str:
        return str(self.options.checkpoint_root)

    # -- weights -----------------------------------------------------------------------------

    def push(
        self,
        checkpoint: str | os.PathLike,
        version: Any = None,
        verify_hash: bool | None = None,
        check_finite: bool | None = None,
    ) -> PushReport:
        """Write ``checkpoint`` (a safetensors file or a directory of shards) into the engine.

        Rejections (bad names, shapes, dtypes, NaN/Inf, a corrupt or torn file, a path outside
        the checkpoint root, weights the reload mode cannot prove or refresh) raise
        :class:`DirectReloadError` or :class:`CheckpointError` before anything is written; the
        engine keeps serving the previous version. A failure after writing started is rolled
        back to the previous version (see the module docstring); the error raised says whether
        that worked. ``version`` (the engine's weight version, what outputs report) defaults
        to the ``version`` entry of the checkpoint's metadata, else the file's name.
        ``verify_hash`` and ``check_finite`` default to the engine's settings.

        A *partial* checkpoint (metadata ``base_version``, see
        :data:`~weight_bridge.checkpoint.BASE_VERSION_KEY`) holds a subset of the tensors and is
        written only when the engine serves exactly that base version; otherwise it is refused,
        naming both versions, before anything is written. It is written directly (never by
        vLLM's layerwise path), and only the modules it writes into are refreshed. A complete
        checkpoint is a valid base at any time.
        """
        path = Path(checkpoint).resolve()
        info: dict[str, Any] = {"checkpoint": str(path), "verify_hash": verify_hash}
        info |= {"check_finite": check_finite}
        if version is not None:  # else the engine's rule: the metadata's version, or file name
            info["version"] = str(version)  # stamped in the step that writes (core_hooks)
        with self._lock:
            started = time.perf_counter()
            self._call(lambda llm: llm.start_weight_update(), "start_weight_update")
            try:
                self._call(lambda llm: llm.update_weights({"update_info": info}), "update_weights")
            except (DirectReloadError, CheckpointError):
                self._note_refusal()
                raise
            except (EngineCoreDeadError, TimeoutError):
                raise  # _call noted what it means for the weights
            except BaseException as exc:
                self._after_failure(exc, "update_weights")
                if self._core_dead() and not isinstance(exc, EngineCoreDeadError):
                    raise EngineCoreDeadError(self._undefined or str(exc)) from exc
                raise
            self._call(
                lambda llm: llm.finish_weight_update(weight_version=info.get("version")),
                "finish_weight_update",
            )
            results = self._results()
            if version is None:
                version = self._call(lambda llm: llm.get_weight_version(), "get_weight_version")
            self._undefined = None
            self.version = version
            self._labels[str(version)] = version
            while len(self._labels) > _LABELS_KEPT:
                del self._labels[next(iter(self._labels))]
            report = PushReport.merged(results, version)
            report.elapsed_s = time.perf_counter() - started
            return report

    def _note_refusal(self) -> None:
        """What a refusal or a rolled-back failure left: undefined weights, the rollback time."""
        results = self._results()
        self._undefined = next((r.undefined for r in results if r.undefined), None)
        self.last_rollback_s = max(
            (r.rollback_s for r in results if r.rollback_s is not None), default=None
        )

    def _results(self) -> list[PushResult]:
        """Every rank's result of the last update (an engine-core utility call)."""
        results = self._call(
            lambda llm: update_results(llm.llm_engine.engine_core), "weight_bridge_results"
        )
        if results:
            self._served = list(results[0].served)
        return results

    @property
    def checkpoint(self) -> str | None:
        """The checkpoint pushed last (after partial pushes, the last partial one; the whole
        chain is :attr:`served_checkpoints`)."""
        return self._served[-1] if self._served else None

    @property
    def served_checkpoints(self) -> list[str]:
        """What the served version is made of: its full checkpoint, then each partial one pushed
        on top of it, in order (all needed to roll back to it)."""
        return list(self._served)

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

    # -- calls into the engine ---------------------------------------------------------------

    def _core_dead(self, grace_s: float = 2.0) -> bool:
        return core_dead(self.llm, grace_s)

    def _rpc(self, method: str, args: tuple = (), timeout: float | None = _DEFAULT) -> list:
        """``collective_rpc`` bounded by ``timeout`` and by the engine core staying alive."""
        timeout = self.rpc_timeout_s if timeout is _DEFAULT else timeout
        return self._call(
            lambda llm: llm.collective_rpc(method, timeout=timeout, args=args), method, timeout
        )

    def _call(self, call: Any, what: str, timeout: Any = _DEFAULT) -> Any:
        timeout = self.rpc_timeout_s if timeout is _DEFAULT else timeout
        if self.llm is None:
            raise RuntimeError("the engine is closed")
        try:
            return watched_call(self.llm, call, what, timeout)
        except (EngineCoreDeadError, TimeoutError) as exc:
            self._after_failure(exc, what)
            raise

    # -- generation --------------------------------------------------------------------------

    def generate(self, prompts: Any, sampling_params: Any = None, **kwargs: Any) -> list[Any]:
        """``vllm.LLM.generate``; each output's ``policy_version`` is the version its tokens were
        sampled with (derived from vLLM's own ``weight_versions`` spans)."""
        with self._lock:
            if self._undefined is not None:
                raise EngineUndefinedError(
                    f"engine weights are undefined ({self._undefined}); push a complete "
                    "checkpoint before generating"
                )
            kwargs.setdefault("use_tqdm", False)
            outputs = self._call(
                lambda llm: llm.generate(prompts, sampling_params, **kwargs), "generate", None
            )
            for out in outputs:
                vars(out)["policy_version"] = self._policy_version(out)
            return outputs

    def _policy_version(self, output: Any) -> Any:
        spans = [s for c in output.outputs for s in (c.weight_versions or ())]
        if not spans:
            return self.version
        label = spans[-1].version
        return self._labels.get(label, None if label == "default" else label)

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
        del llm
        gc.collect()

    def __enter__(self) -> ColocatedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def token_prompts(token_ids: Sequence[Sequence[int]]) -> list[dict]:
    """Prompts given as token ids (sidesteps the tokenizer in tests and toy tasks)."""
    return [{"prompt_token_ids": list(ids)} for ids in token_ids]
