"""``ColocatedEngine``: a ``vllm.LLM`` in this job with the bridge wired in, and its client.

It is the one client of a ``vllm.LLM`` (:class:`~weight_bridge.vllm.clients.llm.LLMClient`: what a
failed push leaves behind, bounded calls, one lock) plus the engine it owns: started with the
backend, colocated memory defaults (:mod:`~weight_bridge.vllm.clients.memory`) and its checkpoint
root, shut down by :meth:`~ColocatedEngine.close`.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Sequence
from typing import Any

from ..internals.engine_client import shutdown
from ..options import SESSION_FIELDS, BridgeOptions
from .launch import bridged_engine_args, engine_environment
from .llm import LLMClient


def _session_property(name: str, doc: str) -> property:
    return property(
        lambda self: getattr(self.options, name),
        lambda self, value: self.configure(**{name: value}),
        doc=doc + "; settable (:meth:`ColocatedEngine.configure`).",
    )


class ColocatedEngine(LLMClient):
    """A ``vllm.LLM`` started with the ``weight_bridge`` backend, and the client that pushes
    into it (:class:`~weight_bridge.vllm.clients.llm.LLMClient`: push, generate, plan, addresses).
    :meth:`close` shuts it down.

    Keywords named like a field of :class:`~weight_bridge.vllm.options.BridgeOptions` are the
    bridge's options (declared there, once; :attr:`options` holds them); every other keyword goes to
    ``vllm.LLM``.

    ``checkpoint_root`` defaults to ``$WEIGHT_BRIDGE_CHECKPOINT_ROOT``, else the current
    directory; the other options are :class:`~weight_bridge.vllm.options.BridgeOptions`'s
    (``rollback`` re-writes from the served files, on which the workers hold descriptors: a
    served file deleted meanwhile still rolls back). ``rpc_timeout_s`` bounds every call into
    the engine (``None``: wait indefinitely); for a multi-process engine it is enforced on this
    side. ``kv_cache_gb``: the engine's KV cache per worker in GiB, on every backend; left
    unset, colocated defaults leave room for the trainer
    (:mod:`weight_bridge.vllm.clients.memory`; explicit vLLM settings win).
    """

    def __init__(
        self,
        model: str | os.PathLike,
        rpc_timeout_s: float | None = 300,
        plugins: Sequence[str] = (),
        kv_cache_gb: float | None = None,
        **kwargs: Any,
    ):
        options, llm_kwargs = BridgeOptions.split(kwargs)
        from vllm import LLM

        self.model = str(model)
        self.options = options
        engine_kwargs = bridged_engine_args(self.model, options, llm_kwargs, kv_cache_gb)
        started = time.perf_counter()
        with engine_environment(plugins):
            llm = LLM(model=self.model, **engine_kwargs)
        self.startup_s = time.perf_counter() - started
        super().__init__(llm, rpc_timeout_s)

    def configure(self, **session: Any) -> None:
        """Change per-update options of the running engine
        (:data:`~weight_bridge.vllm.options.SESSION_FIELDS`): vLLM's ``init_weight_transfer_engine``
        with the bridge's session options."""
        options = self.options.with_session(session)
        chosen = {name: getattr(options, name) for name in SESSION_FIELDS}
        with self._lock:
            self._call(
                lambda llm: llm.init_weight_transfer_engine({"init_info": chosen}),
                "init_weight_transfer_engine",
            )
            self.options = options

    reload_mode = _session_property("reload_mode", "How pushes write (direct, auto, layerwise)")
    rollback = _session_property("rollback", "Whether a push that failed mid-write rolls back")
    check_finite = _session_property("check_finite", "Whether checkpoints with NaN/Inf are refused")
    verify_hash = _session_property("verify_hash", "Whether pushes check the content hash")
    readback = _session_property("readback", "How writes are read back (sampled, full, off)")

    @property
    def checkpoint_root(self) -> str:
        return str(self.options.checkpoint_root)

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
            self.llm = None
        finally:
            if locked:
                self._lock.release()
        shutdown(llm)
        del llm
        gc.collect()
