"""What the bridge reads in vLLM's engine-core client (site 14 of the checklist in
:mod:`weight_bridge.vllm.internals`).

vLLM 0.32's own client waits forever on a call, or a generate, whose engine core process died.
To bound every call, :func:`watched_call` runs it from a helper thread and watches vLLM's own
"engine dead" flag.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ...errors import WeightBridgeError

POLL_S = 0.05  # how often a waiting call looks for a dead engine core


class EngineCoreDeadError(WeightBridgeError, RuntimeError):
    """vLLM's engine core process died (a worker was killed, say); the engine must be restarted."""


def call_core_utility(core_client: Any, name: str) -> Any:
    """An engine-core utility called from an ``LLM``'s engine-core client."""
    inproc = getattr(core_client, "engine_core", None)
    if inproc is not None and hasattr(inproc, name):  # InprocClient holds the core itself
        return getattr(inproc, name)()
    return core_client.call_utility(name)


async def call_core_utility_async(core_client: Any, name: str) -> Any:
    """The same from an ``AsyncLLM``'s engine-core client."""
    return await core_client.call_utility_async(name)


def engine_resources(llm: Any) -> Any:
    """vLLM's multi-process client state (``engine_dead``...), or None if in-process."""
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    resources = getattr(client, "resources", None)
    return resources if hasattr(resources, "engine_dead") else None


def core_dead(llm: Any, grace_s: float = 2.0) -> bool:
    """Whether vLLM marked the engine core process dead, waiting up to ``grace_s`` for its
    once-a-second monitor once a process has exited; always False for an in-process engine.
    """
    resources = engine_resources(llm)
    if resources is None:
        return False
    procs = getattr(getattr(resources, "engine_manager", None), "processes", None) or []
    deadline = time.monotonic() + grace_s
    while not resources.engine_dead:
        if all(p.is_alive() for p in procs) or time.monotonic() > deadline:
            return bool(resources.engine_dead)
        time.sleep(POLL_S)
    return True


def dead_message(resources: Any, what: str) -> str:
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


def watched_call(llm: Any, call: Callable[[Any], Any], what: str, timeout: float | None) -> Any:
    """Run ``call(llm)``; for a multi-process engine, from a helper thread, watched (vLLM 0.32
    waits forever on a call whose engine core process died).

    Raises :class:`EngineCoreDeadError` as soon as the engine core is dead and ``TimeoutError``
    after ``timeout`` seconds. An in-process engine runs the call on this thread, unbounded.
    """
    resources = engine_resources(llm)
    if resources is None:
        return call(llm)
    client = llm.llm_engine.engine_core
    if resources.engine_dead:
        raise EngineCoreDeadError(dead_message(resources, what))
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
    while not done.wait(POLL_S):
        if resources.engine_dead:
            if done.wait(1.0):
                break  # it answered (or failed by itself) as the core went: report that
            _fail_pending(client, EngineCoreDeadError(dead_message(resources, what)))
            raise EngineCoreDeadError(dead_message(resources, what))
        if timeout is not None and time.monotonic() - started > timeout:
            raise timed_out
    if "error" in box:
        error = box["error"]
        if resources.engine_dead:
            raise EngineCoreDeadError(dead_message(resources, what)) from error
        if timeout is not None and type(error) is Exception and "timed out" in str(error):
            # vLLM's executor enforced the same timeout first; its TimeoutError reaches
            # this process as a plain Exception carrying the message.
            raise timed_out from error
        raise error
    return box["result"]


def shutdown(llm: Any) -> None:
    """Stop the engine core (and, multi-process, its processes). An engine core in this
    process tears down vLLM's distributed state, and with it ``torch.distributed``'s default
    process group: when that group is the trainer's (an engine in the trainer's ranks: vLLM
    reused it), the trainer keeps it."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    stop = getattr(core, "shutdown", None)
    if callable(stop):
        with _keeping_default_group():
            stop()


@contextlib.contextmanager
def _keeping_default_group() -> Iterator[None]:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        yield
        return
    destroy = dist.destroy_process_group

    def destroy_all_but_default(group: Any = None) -> None:
        if group is not None and group is not dist.group.WORLD:
            destroy(group)

    dist.destroy_process_group = destroy_all_but_default
    try:
        yield
    finally:
        dist.destroy_process_group = destroy
