"""The client of a ``vllm.LLM`` in this process started with the ``weight_bridge`` backend.

It pushes with the one push routine (:mod:`~weight_bridge.vllm.clients.bridge_client`), never in
flight (a ``vllm.LLM`` generates only when asked). What a failed push leaves behind:

* A checkpoint that does not fit (names, shapes, dtypes, NaN/Inf, a corrupt, truncated, foreign
  or torn file, a shard index that leads out of its directory, a path outside the checkpoint
  root, weights the reload mode cannot prove or refresh) is refused before the first byte is
  written on any rank; the engine keeps serving the previous version. The error
  (:class:`~weight_bridge.direct.DirectReloadError` or
  :class:`~weight_bridge.checkpoint.CheckpointError`, the same in-process and multi-process)
  names the checkpoint, the file and the tensor where there is one, and the problem.
* A failure after writing started (in a weight loader, in the refresh of derived state, in the
  read-back) is rolled back: every rank re-writes the version it served, from that version's
  checkpoints, and keeps serving it; the error says so (``last_rollback_s`` says how long it
  took). Only if the rollback fails too is the engine left *undefined*: :meth:`LLMClient.generate`
  raises :class:`EngineUndefinedError` naming why, until a complete push succeeds.
* With a multi-process engine (vLLM's default), every call into the engine waits at most
  ``rpc_timeout_s`` and stops waiting as soon as vLLM marks the engine core process dead
  (:class:`EngineCoreDeadError`): a worker that dies or hangs mid-push is an error within a
  bounded time, never a hang. ``generate`` is watched the same way, without the timeout. An
  in-process engine runs the call on the caller's thread: it cannot be bounded.

Concurrency: every push, generate and worker call holds one re-entrant lock, so calls from
several threads run one at a time and each generate call is served by exactly one version. The
lock goes to threads in the order they asked
(:class:`~weight_bridge.vllm.clients.fair_lock.FairLock`): a thread pushing in a loop cannot keep a
generate waiting. ``.llm`` bypasses both the lock and the undefined check: use it only for what the
bridge does not offer, never concurrently with a push.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Coroutine, Sequence
from typing import Any

from ..core.adapters import chosen_adapter
from ..errors import EngineUndefinedError, undefined_message
from ..generation import Generation, engine_prompt
from ..internals.engine_client import (
    EngineCoreDeadError,
    call_core_utility,
    core_dead,
    dead_message,
    engine_resources,
    watched_call,
)
from ..internals.lora import lora_request
from ..internals.objects import config_of, core_client_of
from ..options import BACKEND_RPC
from ..report import PushReport, report_of
from ..server.typed_errors import update_report
from .bridge_client import BridgeClient, run_blocking
from .fair_lock import FairLock

_ADAPTERS = "weight_bridge_adapters"  # the engine-core utility (core.adapters)
_PROBE_TIMEOUT_S = 30.0  # the most the post-failure "are you undefined?" probe may wait
_DEFAULT: Any = object()


class LLMClient(BridgeClient):
    """Pushes into, and generates with, a ``vllm.LLM`` started with
    ``weight_transfer_config={"backend": "weight_bridge"}``; typed errors, bounded calls
    (``rpc_timeout_s``; ``None``: wait indefinitely). The ``LLM`` is the caller's:
    :meth:`close` leaves it running."""

    def __init__(self, llm: Any, rpc_timeout_s: float | None = 300) -> None:
        super().__init__(inflight=None)
        if rpc_timeout_s is not None and not rpc_timeout_s > 0:
            raise ValueError(f"rpc_timeout_s must be positive or None, not {rpc_timeout_s!r}")
        self.llm = llm
        self.rpc_timeout_s = rpc_timeout_s
        self._undefined: str | None = None
        self._lock = FairLock()
        self._submitted: concurrent.futures.ThreadPoolExecutor | None = None

    # -- weights -----------------------------------------------------------------------------

    pauses = False  # a vllm.LLM generates only when asked: nothing runs during a push

    @property
    def in_process(self) -> bool:
        """An engine core in this process driving its one worker, or vLLM's external
        launcher's (not a multi-process executor's workers)."""
        backend = config_of(self.llm).parallel_config.distributed_executor_backend
        return engine_resources(self.llm) is None and backend in ("uni", "external_launcher")

    def _blocking(self, push: Coroutine[Any, Any, PushReport]) -> PushReport:
        with self._lock:
            return run_blocking(push)

    def _pushed(self, report: PushReport) -> None:
        super()._pushed(report)
        self._undefined = None

    async def _start(self) -> None:
        self._call(lambda llm: llm.start_weight_update(), "start_weight_update")

    async def _update(self, info: dict) -> None:
        self._call(lambda llm: llm.update_weights({"update_info": info}), "update_weights")

    async def _finish(self, version: str | None) -> None:
        self._call(
            lambda llm: llm.finish_weight_update(weight_version=version), "finish_weight_update"
        )

    async def _report(self) -> PushReport | None:
        return self._call(lambda llm: update_report(core_client_of(llm)), "weight_bridge_results")

    async def _failed(self, error: BaseException) -> None:
        report = report_of(error)  # a refusal, or a failure rolled back: the engine's answer
        if report is not None:
            self._note_failure(report)
            return
        if isinstance(error, (EngineCoreDeadError, TimeoutError)):
            return  # _call noted what it means for the weights
        self._after_failure(error, "update_weights")
        if self._core_dead():
            raise EngineCoreDeadError(self._undefined or str(error)) from error

    def _note_failure(self, report: PushReport) -> None:
        super()._note_failure(report)
        self._undefined = report.undefined

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
            reasons = [r for r in self._rpc("undefined", timeout=timeout) if r]
        except Exception as probe:  # the workers cannot even answer: assume the worst
            reasons = [f"workers unreachable after a failed push ({type(probe).__name__}: {probe})"]
        if reasons:
            self._undefined = reasons[0]

    def plan(self, mode: str | None = None) -> list[dict]:
        """Per worker, a dry run of a push in ``mode`` (default: the reload mode the workers push
        with now, after any ``configure``): per weight its write target (relocation, refresh),
        the modules re-processed, the refusals."""
        with self._lock:
            return self._rpc("plan", (mode,))

    def addresses(self) -> list[dict[str, tuple]]:
        """Per worker, every parameter/buffer name -> (data_ptr, shape, stride, dtype)."""
        with self._lock:
            return self._rpc("addresses")

    def fingerprints(self) -> list[dict[str, str]]:
        """Per worker, checkpoint name -> the exact fingerprint of the full tensor it holds
        (:mod:`weight_bridge.exact`; tensors it holds whole): to prove it holds a trainer's
        bits."""
        with self._lock:
            return self._rpc("fingerprints")

    @property
    def undefined(self) -> str | None:
        """Why the engine refuses to generate (a push failed mid-way), or None."""
        return self._undefined

    # -- calls into the engine ---------------------------------------------------------------

    def _core_dead(self, grace_s: float = 2.0) -> bool:
        return core_dead(self.llm, grace_s)

    def _rpc(self, action: str, args: tuple = (), timeout: float | None = _DEFAULT) -> list:
        """One backend action on every worker
        (:func:`~weight_bridge.vllm.worker.backend.call_backend`), bounded by ``timeout`` and by the
        engine core staying alive."""
        timeout = self.rpc_timeout_s if timeout is _DEFAULT else timeout
        return self._call(
            lambda llm: llm.collective_rpc(BACKEND_RPC, timeout=timeout, args=(action, *args)),
            action,
            timeout,
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

    def generate(
        self, prompts: Sequence[Any], sampling: Any = None, version: Any = None
    ) -> list[Generation]:
        """``vllm.LLM.generate`` of ``prompts`` (token ids, ``{"prompt_token_ids": ...}`` or
        text) with ``sampling`` (a dict of vLLM's sampling parameters, or a ``SamplingParams``):
        one :class:`~weight_bridge.vllm.generation.Generation` per prompt, each token labelled
        with the version that sampled it (vLLM's own ``weight_versions`` spans). Where adapter
        versions are resident in the engine's LoRA slots, the newest samples, or ``version``."""
        params = sampling_params(sampling)
        engine_prompts = [engine_prompt(p) for p in prompts]
        with self._lock:
            if self._undefined is not None:
                raise EngineUndefinedError(undefined_message(self._undefined))
            adapter = lora_request(chosen_adapter(self._adapters(), version))
            outputs = self._call(
                lambda llm: llm.generate(
                    engine_prompts, params, use_tqdm=False, lora_request=adapter
                ),
                "generate",
                None,
            )
            return [
                Generation.from_request_output(o, params.logprobs, self.version) for o in outputs
            ]

    @property
    def takes_adapters(self) -> bool:  # type: ignore[override]
        """Whether the engine was started with LoRA slots (``enable_lora=True``)."""
        return config_of(self.llm).lora_config is not None

    def _adapters(self) -> dict[str, dict]:
        """The adapter versions resident in the engine's LoRA slots (none without LoRA)."""
        if not self.takes_adapters:
            return {}
        return self._call(lambda llm: call_core_utility(core_client_of(llm), _ADAPTERS), _ADAPTERS)

    def submit(
        self, prompts: Sequence[Any], sampling: Any = None, version: Any = None
    ) -> concurrent.futures.Future[list[Generation]]:
        """:meth:`generate` on a thread of this client's (a ``vllm.LLM`` generates one call at a
        time: a push waits for it, in the order asked)."""
        if self._submitted is None:
            self._submitted = concurrent.futures.ThreadPoolExecutor(1, "weight-bridge-generate")
        return self._submitted.submit(self.generate, list(prompts), sampling, version)


def sampling_params(sampling: Any) -> Any:
    """A ``vllm.SamplingParams`` from a dict of its fields (None: the defaults), or as given."""
    from vllm import SamplingParams

    if sampling is None:
        return SamplingParams()
    if isinstance(sampling, SamplingParams):
        return sampling
    if isinstance(sampling, dict):
        return SamplingParams(**sampling)
    raise TypeError(f"sampling must be a dict or a SamplingParams, not {type(sampling).__name__}")


def token_prompts(token_ids: Sequence[Sequence[int]]) -> list[dict]:
    """Prompts given as token ids (sidesteps the tokenizer in tests and toy tasks)."""
    return [{"prompt_token_ids": list(ids)} for ids in token_ids]
