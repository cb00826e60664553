"""The ``weight_bridge`` weight-transfer backend: vLLM's own RL update API, by direct reload.

vLLM builds one backend per worker (each tensor-parallel rank) in ``Worker.load_model``, when the
engine is started with ``weight_transfer_config={"backend": "weight_bridge"}``; the plugin
registers it. A trainer then drives the engine with vLLM's own calls, from
``LLM``, ``AsyncLLM`` or ``vllm serve``'s HTTP routes::

    llm.init_weight_transfer_engine({"init_info": {}})           # optional: session options
    llm.start_weight_update()
    llm.update_weights({"update_info": {"checkpoint": "/ckpts/step-10.safetensors"}})
    llm.finish_weight_update(weight_version="10")

Each ``update_weights`` is one transaction (:mod:`~weight_bridge.vllm.worker.transaction`): every
rank checks the whole checkpoint before any rank writes, then writes, reads back and refreshes; a
failure past the first write rolls every rank back to the version served. The engine core
(:mod:`~weight_bridge.vllm.core.updates`) drives the ranks through those phases with
:func:`call_backend` and raises the refusal, naming each tensor, from ``update_weights``.

:func:`call_backend` is the bridge's one channel into the workers: besides the phases, its
read-only actions (:data:`QUERIES`, :mod:`~weight_bridge.vllm.worker.queries`) answer a plan, the
weights' addresses and
why the weights are undefined, one answer per worker::

    llm.collective_rpc(BACKEND_RPC, timeout=60, args=("plan", "auto"))   # any engine
    llm.collective_rpc(call_backend, timeout=60, args=("plan", "auto"))  # in-process engine

(the engine core routes the method name :data:`~weight_bridge.vllm.options.BACKEND_RPC` to
:func:`call_backend`; a function itself crosses from a multi-process engine's client to its core
only with vLLM's ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from ..internals.model import reset_runner_caches, transfer_engine
from ..internals.objects import config_of
from ..internals.versions import check_vllm_version
from ..options import BridgeOptions, bridge_options
from ..outcome import Phase
from .adapter_writer import worker_adapters
from .queries import worker_addresses, worker_fingerprints, worker_plan, worker_undefined
from .transaction import PushTransaction
from .update_request import UpdateRequest

_QUERIES: dict[str, Callable[..., Any]] = {
    "plan": worker_plan,  # args: the mode (default: the one the worker pushes with)
    "addresses": worker_addresses,
    "undefined": worker_undefined,
    "fingerprints": worker_fingerprints,
    "adapters": worker_adapters,  # the LoRA slots: ids, CPU copies, each slot's fingerprints
}
QUERIES = tuple(_QUERIES)  # the read-only actions: answered by any worker, bridged or not


def worker_rank() -> int:
    """This worker's rank in vLLM's world group (0 without distributed state)."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        return int(get_world_group().rank_in_group)
    except Exception:  # no distributed state: a single in-process worker
        return 0


class WeightBridgeEngine(WeightTransferEngine[dict, UpdateRequest]):  # type: ignore[type-var]
    """One worker's backend: vLLM's four calls mapped onto a :class:`PushTransaction`.

    ``init_info``: a trainer's session options, a dict of
    :data:`~weight_bridge.vllm.options.SESSION_FIELDS` (None: keep the engine's), checked by
    :meth:`~weight_bridge.vllm.options.BridgeOptions.with_session`."""

    init_info_cls = dict
    update_info_cls = UpdateRequest
    supports_draft_weight_update = False

    def __init__(
        self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module
    ) -> None:
        check_vllm_version()  # an untested vLLM is refused here, in every entry point
        super().__init__(config, vllm_config, device, model)
        self.options = bridge_options(vllm_config) or BridgeOptions()
        self.transaction = PushTransaction(
            model, vllm_config.model_config, self.options, worker_rank()
        )

    def parse_update_info(self, update_dict: dict[str, Any]) -> UpdateRequest:
        return UpdateRequest.from_dict(dict(update_dict))

    def parse_init_info(self, init_dict: dict[str, Any]) -> dict:
        return dict(init_dict)

    def init_transfer_engine(self, init_info: dict) -> None:
        chosen = {k: v for k, v in init_info.items() if v is not None}
        self.transaction.options = self.options.with_session(chosen)

    def start_weight_update(self) -> None:
        self.transaction.run(Phase.ABANDON)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # PREPARE only (nothing written), for a caller that reaches the worker without the
        # engine core's transaction (which sends PREPARE itself: see
        # weight_bridge.vllm.core.updates). Never raises: a worker that raised would leave
        # vLLM's multi-process executor with the other ranks' replies queued.
        self.transaction.run(Phase.PREPARE, update_info)

    def receive_weights(self, update_info: UpdateRequest) -> None:
        self.transaction.run(Phase.PREPARE, update_info)

    def finish_weight_update(self) -> None:
        # The update is over: no rank rolls back to the chain served before it any more.
        self.transaction.run(Phase.SETTLE)

    def shutdown(self) -> None:
        """A trainer disconnected: nothing to release (the served chain stays for rollback)."""


def call_backend(worker: Any, action: str, *args: Any) -> Any:
    """Run ``action`` in ``worker`` (sent with ``collective_rpc``, by the engine core or by a
    client): a read-only one of :data:`QUERIES` returns its answer; a :class:`Phase` of the
    update (the engine core's) returns this rank's
    :class:`~weight_bridge.vllm.outcome.PushResult` as a dict."""
    from vllm.config import set_current_vllm_config

    query = _QUERIES.get(action)
    if query is not None:
        return query(worker, *args)
    engine = transfer_engine(worker)
    if not isinstance(engine, WeightBridgeEngine):
        raise RuntimeError("this worker does not run the weight_bridge weight-transfer backend")
    try:
        phase = Phase(action)
    except ValueError:
        raise ValueError(f"unknown backend action {action!r}") from None
    if phase is Phase.PREPARE:
        args = (_local_info(worker, args[0]),)
    elif phase is Phase.COMMIT:  # then the encoder and multi-modal caches: old outputs
        args = (worker.reload_weights, partial(reset_runner_caches, worker))
    elif phase is Phase.ROLL_BACK:
        args = (worker.reload_weights, *args)
    with set_current_vllm_config(config_of(worker)), _collector_paused():
        return engine.transaction.run(phase, *args).to_dict()


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for one phase: a full collection over an engine's
    objects takes tens of milliseconds (measured: 70 ms in a 100m model's push from memory,
    three times the write), and a phase makes few cycles; refcounting still frees the rest."""
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


def _local_info(worker: Any, info: Any) -> Any:
    """This worker's ``update_info``, as vLLM's own ``update_weights`` picks it: a list is
    indexed by the worker's global rank across data-parallel replicas."""
    if not isinstance(info, list):
        return info
    parallel = config_of(worker).parallel_config
    rank = getattr(parallel, "data_parallel_index", 0) * parallel.world_size + worker.rank
    # out of range: the list itself, which PREPARE refuses as a malformed request
    return info[rank] if 0 <= rank < len(info) else info
