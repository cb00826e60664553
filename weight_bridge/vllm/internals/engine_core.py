"""What the bridge reads and drives inside vLLM's engine core (sites 11 to 13 and 18 of the
checklist in :mod:`weight_bridge.vllm.internals`): the prefix cache, the scheduler's pause
state, the served weight version, how it waits for its workers."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import Any

from .objects import config_of


def engine_ranks_group(core: Any) -> Any | None:
    """The process group of every rank of an engine started with vLLM's external launcher
    (vLLM's world group, on the trainer's own ``torch.distributed`` world), where each rank's
    engine core drives only its own worker; None where one core drives every worker."""
    parallel = getattr(config_of(core), "parallel_config", None)
    launcher = getattr(parallel, "distributed_executor_backend", None) == "external_launcher"
    if not launcher or getattr(parallel, "world_size", 1) <= 1:
        return None
    from vllm.distributed.parallel_state import get_world_group

    group = get_world_group().cpu_group
    timeout = _trainer_timeout()
    if timeout is not None:  # vLLM made it with torch's default (30 min), not the trainer's
        group.set_timeout(timeout)
    return group


def _trainer_timeout() -> Any:
    """The trainer's process-group timeout (its default group's, as its strategy set it, such
    as Lightning's ``DDPStrategy(timeout=...)``), None where it cannot be read."""
    import torch
    import torch.distributed as dist

    default = dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        with contextlib.suppress(Exception):
            return default._get_backend(torch.device(device)).options._timeout
    return None


def across_engine_ranks(core: Any, answers: list) -> list:
    """``answers`` of this core's workers, with every other rank's core's (each core reaches
    the same call in the same order: its decisions follow from what all answered), in rank
    order; as they are where one core drives every worker."""
    group = engine_ranks_group(core)
    if group is None:
        return answers
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, list(answers), group=group)
    return [answer for part in gathered for answer in part]


def served_version(core: Any) -> str | None:
    """The weight version the engine core stamps on outputs (vLLM's own, set by
    ``finish_weight_update(weight_version=...)``)."""
    version = getattr(core, "_weight_version", None)
    return None if version is None else str(version)


def _salted(hasher: Any, salt: bytes) -> Any:
    def salted_hasher(request: Any) -> list:
        return [type(h)(hashlib.sha256(salt + h).digest()[: len(h)]) for h in hasher(request)]

    salted_hasher.weight_bridge_salted = True  # type: ignore[attr-defined]
    return salted_hasher


def forget_prefixes(core: Any, salt: str) -> str:
    """Make sure no request arriving from now on reuses KV computed before this call.

    vLLM's own ``reset_prefix_cache`` does that only when no running request holds a block:
    then ``"reset"``. Else ``"forgotten"``: every cached block (held ones too) loses its hash,
    so no new request can hit it, and every running request's *future* blocks get hashes no
    new request can compute (its block hasher is salted): they hold KV partly computed by the
    old weights.
    """
    if core.reset_prefix_cache():
        return "reset"
    scheduler = core.scheduler
    pools = {
        id(m.block_pool): m.block_pool
        for m in scheduler.kv_cache_manager.coordinator.single_type_managers
    }
    for pool in pools.values():
        extra = pool.cached_block_hashes_by_block
        for block in pool.blocks:
            if block.block_hash is not None or block.block_id in extra:
                pool._maybe_evict_cached_block(block)
    seed = salt.encode()
    for request in scheduler.running:
        hasher = getattr(request, "_block_hasher", None)
        if hasher is not None:
            request._block_hasher = _salted(hasher, seed)
    return "forgotten"


def requests_with_lora(core: Any, lora_id: int) -> int:
    """How many unfinished requests the scheduler holds (running, waiting or preempted) that
    compute with the LoRA adapter ``lora_id``."""
    return sum(
        1
        for request in list(core.scheduler.requests.values())
        if not request.is_finished()
        and getattr(request.lora_request, "lora_int_id", None) == lora_id
    )


def pause_scheduling(core: Any) -> Any:
    """Pause all scheduling (running requests preempted) and drop every cached KV; the pause
    state before, for :func:`set_pause_state`."""
    from vllm.v1.core.sched.interface import PauseState

    scheduler = core.scheduler
    before = scheduler.pause_state
    scheduler.set_pause_state(PauseState.PAUSED_ALL)
    scheduler.reset_prefix_cache(reset_running_requests=True)  # nothing keeps old KV
    return before


def finish_every_request(core: Any, reason: str) -> dict[int, Any]:
    """Finish every request the scheduler holds with vLLM's ``error`` finish reason and
    ``reason`` as its ``stop_reason``: what one engine step returns (client index -> outputs),
    so each caller's own loop (``LLM.generate``, ``AsyncLLM``, the API server) ends them."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
    from vllm.v1.request import RequestStatus

    scheduler = core.scheduler
    by_client: dict[int, list[str]] = {}
    for request in list(scheduler.requests.values()):
        if not request.is_finished():
            by_client.setdefault(request.client_index, []).append(request.request_id)
    scheduler.finish_requests(
        [i for ids in by_client.values() for i in ids], RequestStatus.FINISHED_ERROR
    )
    return {
        client: EngineCoreOutputs(
            outputs=[
                EngineCoreOutput(i, [], finish_reason=FinishReason.ERROR, stop_reason=reason)
                for i in ids
            ],
            finished_requests=set(ids),
        )
        for client, ids in by_client.items()
    }


def unpause_scheduling(core: Any) -> Any:
    """Let the core's loop step again: vLLM's multi-process core steps only while its scheduler
    counts unfinished requests, and a scheduler paused for all counts none. The state set, for
    :func:`set_pause_state`."""
    from vllm.v1.core.sched.interface import PauseState

    core.scheduler.set_pause_state(PauseState.UNPAUSED)
    return PauseState.UNPAUSED


def set_pause_state(core: Any, state: Any) -> None:
    core.scheduler.set_pause_state(state)


def _reply_waits(core: Any) -> list[Any]:
    """The spin conditions the engine core waits on for its workers' replies (none for an
    executor without vLLM's shared-memory message queues)."""
    queues = getattr(getattr(core, "model_executor", None), "response_mqs", None) or ()
    conditions = [getattr(mq, "_spin_condition", None) for mq in queues]
    return [c for c in conditions if c is not None and hasattr(c, "busy_loop_s")]


@contextlib.contextmanager
def waiting_without_spinning(core: Any) -> Iterator[int]:
    """While inside, the engine core waits for its workers' replies asleep on the queue's
    notification socket instead of spinning for up to a second after each reply, so a push's
    helper threads can use its CPU; yields how many queues it changed."""
    conditions = _reply_waits(core)
    before = [c.busy_loop_s for c in conditions]
    for condition in conditions:
        condition.busy_loop_s = 0
    try:
        yield len(conditions)
    finally:
        for condition, value in zip(conditions, before, strict=True):
            condition.busy_loop_s = value
