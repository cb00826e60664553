"""The ``weight_bridge`` weight-transfer backend: vLLM's own RL update API, by direct reload.

vLLM builds one backend per worker (each tensor-parallel rank) in ``Worker.load_model``, when the
engine is started with ``weight_transfer_config={"backend": "weight_bridge"}``; the plugin
registers it. A trainer then drives the engine with vLLM's own calls, from
``LLM``, ``AsyncLLM`` or ``vllm serve``'s HTTP routes::

    llm.init_weight_transfer_engine({"init_info": {}})           # optional: session options
    llm.start_weight_update()
    llm.update_weights({"update_info": {"checkpoint": "/ckpts/step-10.safetensors"}})
    llm.finish_weight_update(weight_version="10")

Each ``update_weights`` is one transaction (:mod:`.transaction`): every rank checks the whole
checkpoint before any rank writes, then writes, reads back and refreshes; a failure past the
first write rolls every rank back to the version served. The engine core
(:mod:`.core_hooks`) drives the ranks through those phases with :func:`call_backend` and
raises the refusal, naming each tensor, from ``update_weights``.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from .options import BridgeOptions, SessionOptions, bridge_options
from .results import UpdateRequest
from .transaction import PushTransaction

__all__ = ["WeightBridgeEngine", "call_backend"]


def _rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_world_group

        return int(get_world_group().rank_in_group)
    except Exception:  # no distributed state: a single in-process worker
        return 0


class WeightBridgeEngine(WeightTransferEngine[SessionOptions, UpdateRequest]):  # type: ignore[type-var]
    """One worker's backend: vLLM's four calls mapped onto a :class:`PushTransaction`."""

    init_info_cls = SessionOptions
    update_info_cls = UpdateRequest
    supports_draft_weight_update = False

    def __init__(
        self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.options = bridge_options(vllm_config) or BridgeOptions()
        self.transaction = PushTransaction(model, vllm_config.model_config, self.options, _rank())

    def parse_update_info(self, update_dict: dict[str, Any]) -> UpdateRequest:
        return UpdateRequest.from_dict(dict(update_dict))

    def init_transfer_engine(self, init_info: SessionOptions) -> None:
        chosen = {k: v for k, v in asdict(init_info).items() if v is not None}
        self.transaction.options = self.options.with_session(chosen)

    def start_weight_update(self) -> None:
        self.transaction.abandon()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # Phase 1 only (nothing written, nothing asynchronous to wait for): the engine core
        # commits once every rank prepared (see weight_bridge.vllm.core_hooks). A malformed
        # request is a refusal too: a worker that raised would leave vLLM's multi-process
        # executor with the other ranks' replies queued.
        try:
            request = self.parse_update_info(update_info)
        except (TypeError, ValueError) as exc:
            self.transaction.refuse(f"invalid update_info: {exc}")
            return
        self.receive_weights(request)

    def receive_weights(self, update_info: UpdateRequest) -> None:
        self.transaction.prepare(update_info)

    def finish_weight_update(self) -> None:
        self.transaction.abandon()

    def shutdown(self) -> None:
        """A trainer disconnected: nothing to release (the served chain stays for rollback)."""


def call_backend(worker: Any, action: str, *args: Any) -> dict[str, Any]:
    """Run one phase of the update in ``worker`` (sent by the engine core with
    ``collective_rpc``); this rank's :class:`~.results.PushResult` as a dict."""
    from vllm.config import set_current_vllm_config

    engine = getattr(worker, "weight_transfer_engine", None)
    if not isinstance(engine, WeightBridgeEngine):
        raise RuntimeError("this worker does not run the weight_bridge weight-transfer backend")
    transaction = engine.transaction
    with set_current_vllm_config(worker.vllm_config):
        if action == "commit":
            result = transaction.commit(worker.reload_weights)
            if result.error is None:
                _reset_runner_caches(worker)
        elif action == "roll_back":
            result = transaction.roll_back(worker.reload_weights, *args)
        elif action == "fail":
            result = transaction.fail(*args)
        elif action == "abandon":
            transaction.abandon()
            result = transaction.result
        elif action == "result":
            result = transaction.result
        else:
            raise ValueError(f"unknown backend action {action!r}")
    return result.to_dict()


def _reset_runner_caches(worker: Any) -> None:
    """Encoder and multi-modal caches hold outputs of the old weights."""
    runner = worker.model_runner
    for name in ("reset_encoder_cache", "reset_mm_cache"):
        reset = getattr(runner, name, None)
        if callable(reset):
            reset()
