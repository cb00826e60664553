"""FAULT INJECTION for engines a test cannot reach into (a ``vllm serve`` process, a
multi-process or tensor-parallel engine, an engine in a trainer's ranks), and the fault points
of an update, generated from the code.

Started with ``WEIGHT_BRIDGE_PLUGINS=faults:register`` (:data:`FAULTS`) and
``WEIGHT_BRIDGE_TEST_FAULT_FILE=PATH`` (or :func:`install` in the test's own process), every
process of the engine wraps each fault point once; a wrapper raises while ``PATH`` arms it:

* a file that reads ``once`` or anything else but JSON: the refresh of derived state raises a
  ``RuntimeError`` (``once``: the file is removed as the fault fires, so the rollback that
  follows refreshes as usual);
* a JSON list of ``{"point": P, "kind": K, "rank": R}`` (:func:`arm_file`): the point ``P`` of
  :func:`fault_points` raises an exception of kind ``K`` (:data:`KINDS`) in the process of rank
  ``R`` (any rank: null), each once: the process that fires one takes it off the list first
  (the file goes with the last), so a second fault can strike the recovery from the first.

A file ``PATH.slow`` (:func:`slowed`) makes the engine slow instead: each scheduler step
sleeps :data:`SLOW_STEP_S` first (a loaded machine, on purpose), so that a test that pauses
generations once they have a few tokens reaches them before they end on any machine.

Nothing else changes; an unarmed wrapper costs one ``os.path.exists``.

A module of the tests, not of the product (nothing in ``weight_bridge`` imports it): the engine
processes import it as the top-level module ``faults`` because the tests put ``tests/`` on the
``PYTHONPATH`` every process they start inherits (``helpers.py``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

FAULT_FILE_ENV = "WEIGHT_BRIDGE_TEST_FAULT_FILE"
FAULTS = "faults:register"  # the plugin spec (tests/ is on every engine process's path)
ENDS = ("enter", "return")  # a phase's fault raises as it is entered, or as it returns
SLOW_STEP_S = 0.05  # the sleep before each scheduler step of a slowed engine


def _kinds() -> dict[str, Callable[[str], BaseException]]:
    from weight_bridge.direct import DirectReloadError

    return {"refusal": DirectReloadError, "ValueError": ValueError, "MemoryError": MemoryError}


#: the kinds of exception a point raises: the project's typed error, a parser's untyped
#: ``ValueError``, and a failed allocation
KINDS = ("refusal", "ValueError", "MemoryError")


def fault_points() -> list[str]:
    """Every point of an update a fault can strike, from the code itself: each
    :class:`~weight_bridge.vllm.outcome.Phase` of the worker's transaction as it is entered and
    as it returns, each writer of the registry (:data:`~weight_bridge.vllm.worker.writers.
    WRITERS`) as it starts, the weight loader after the first tensor was written, and the
    refresh of derived state after the write, the gather of a sharded tensor pushed from
    memory as it starts (its local part) and as it returns (after the communication, on this
    rank alone), and the host store's copy in the background after an update landed."""
    from weight_bridge.vllm.outcome import Phase
    from weight_bridge.vllm.worker.writers import WRITERS

    phases = [f"{phase.value}:{end}" for phase in Phase for end in ENDS]
    writers = [f"writer:{mode}" for mode in WRITERS]
    gather = [f"gather:{end}" for end in ENDS]
    return [*phases, *writers, "loader", "refresh", "prefix_reset", *gather, "store_refresh"]


def arm_file(path: str | os.PathLike, *faults: tuple[str, str, int | None]) -> None:
    """Arm each ``(point, kind, rank)`` of ``faults`` (a point of :func:`fault_points`, a kind
    of :data:`KINDS`, a rank or None) to raise once, in that order."""
    for point, kind, _ in faults:
        if point not in fault_points() or kind not in KINDS:
            raise ValueError(f"unknown fault {point!r}/{kind!r}")
    _write(os.fspath(path), [{"point": p, "kind": k, "rank": r} for p, k, r in faults])


def _write(path: str, specs: list[dict]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(specs, f)
    os.replace(tmp, path)


@contextlib.contextmanager
def slowed(path: str | os.PathLike) -> Iterator[None]:
    """The engine armed by the fault file ``path`` sleeps :data:`SLOW_STEP_S` before each
    scheduler step while this runs."""
    slow = Path(f"{os.fspath(path)}.slow")
    slow.touch()
    try:
        yield
    finally:
        slow.unlink(missing_ok=True)


def register() -> None:
    """Install the wrappers in this process (a vLLM plugin function) when the fault file is
    named in its environment."""
    path = os.environ.get(FAULT_FILE_ENV)
    if path:
        install(path)


def install(path: str | os.PathLike) -> None:
    """Wrap every fault point in this process, armed by the file at ``path``."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from weight_bridge.checkpoint.dtensor import ShardGather
    from weight_bridge.direct import delta, session, undo
    from weight_bridge.direct.readback import ReadBack
    from weight_bridge.vllm.core import updates
    from weight_bridge.vllm.outcome import Phase
    from weight_bridge.vllm.worker import writers
    from weight_bridge.vllm.worker.transaction import PushTransaction

    path = os.fspath(path)
    if getattr(PushTransaction, "fault_file", None) == path:
        return  # installed already
    PushTransaction.fault_file = path  # type: ignore[attr-defined]
    for phase in Phase:
        method = getattr(PushTransaction, phase.value)
        setattr(PushTransaction, phase.value, _around(path, phase.value, method))
    for mode, prepare in list(writers.WRITERS.items()):
        writers.WRITERS[mode] = _writer(path, mode, getattr(prepare, "unwrapped", prepare))
    track = getattr(ReadBack.track, "unwrapped", ReadBack.track)
    ReadBack.track = _loader(path, track)  # type: ignore[method-assign]
    for module in (session, delta):
        refresh = getattr(module.refresh_derived_state, "unwrapped", module.refresh_derived_state)
        module.refresh_derived_state = _at(path, "refresh", refresh)  # type: ignore[attr-defined]
    forget = getattr(updates.forget_prefixes, "unwrapped", updates.forget_prefixes)
    updates.forget_prefixes = _at(path, "prefix_reset", forget)
    # a gather's local part (this rank alone, before the ranks agree), and its end (after
    # the communication every rank took part in)
    for method, end in (("prepare", "enter"), ("run", "return")):
        setattr(ShardGather, method, _around(path, "gather", getattr(ShardGather, method), (end,)))
    copy_back = getattr(undo._copy_back, "unwrapped", undo._copy_back)
    undo._copy_back = _at(path, "store_refresh", copy_back)
    schedule = getattr(Scheduler.schedule, "unwrapped", Scheduler.schedule)
    Scheduler.schedule = _slow(f"{path}.slow", schedule)  # type: ignore[method-assign]


def _slow(slow: str, schedule: Callable) -> Callable:
    @functools.wraps(schedule)
    def schedule_slowly(*args: Any, **kwargs: Any) -> Any:
        if os.path.exists(slow):
            time.sleep(SLOW_STEP_S)
        return schedule(*args, **kwargs)

    schedule_slowly.unwrapped = schedule  # type: ignore[attr-defined]
    return schedule_slowly


def _fire(path: str, point: str) -> None:
    """Raise the armed fault if it is ``point``'s on this rank (removing the file first)."""
    if not os.path.exists(path):
        return
    specs = _specs(path)
    if specs is None:
        if point != "refresh":
            return
        if _reads(path) == "once":  # disarmed as it fires: the rollback's refresh works
            with contextlib.suppress(OSError):
                os.unlink(path)
        raise RuntimeError(f"injected fault: {path} exists")
    mine = [s for s in specs if s.get("point") == point and s.get("rank") in (None, _rank())]
    if not mine:
        return
    rest = [s for s in specs if s is not mine[0]]
    if rest:
        _write(path, rest)
    else:
        try:
            os.unlink(path)
        except OSError:
            return  # another rank fired it
    raise _kinds()[mine[0]["kind"]](f"injected fault at {point} ({mine[0]['kind']})")


def _specs(path: str) -> list[dict] | None:
    try:
        specs = json.loads(_reads(path))
    except ValueError:
        return None
    return specs if isinstance(specs, list) else None


def _rank() -> int:
    from weight_bridge.vllm.worker.backend import worker_rank

    return worker_rank()


def _around(path: str, name: str, method: Any, ends: tuple[str, ...] = ENDS) -> Any:
    """``method`` with the point ``name:END`` firing as it is entered and as it returns, for
    each END of ``ends``."""
    method = getattr(method, "unwrapped", method)

    @functools.wraps(method)
    def faulty(*args: Any, **kwargs: Any) -> Any:
        if "enter" in ends:
            _fire(path, f"{name}:enter")
        result = method(*args, **kwargs)
        if "return" in ends:
            _fire(path, f"{name}:return")
        return result

    faulty.unwrapped = method  # type: ignore[attr-defined]
    return faulty


def _writer(path: str, mode: str, prepare: Callable) -> Callable:
    def prepare_faulty(job: Any, chosen: Any) -> Any:
        writer = prepare(job, chosen)
        run = writer.run

        def run_faulty() -> Any:
            _fire(path, f"writer:{mode}")
            return run()

        writer.run = run_faulty
        return writer

    prepare_faulty.unwrapped = prepare  # type: ignore[attr-defined]
    return prepare_faulty


def _loader(path: str, track: Callable) -> Callable:
    def track_faulty(self: Any, weights: Any) -> Any:
        for i, item in enumerate(track(self, weights)):
            if i == 1:  # the first tensor is written: mid-write
                _fire(path, "loader")
            yield item

    track_faulty.unwrapped = track  # type: ignore[attr-defined]
    return track_faulty


def _at(path: str, point: str, function: Callable) -> Callable:
    def faulty(*args: Any, **kwargs: Any) -> Any:
        _fire(path, point)
        return function(*args, **kwargs)

    faulty.unwrapped = function  # type: ignore[attr-defined]
    return faulty


def _reads(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""
