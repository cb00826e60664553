"""A push's independent jobs on the calling thread and on helper threads pinned to spare CPUs.

Why: an inference engine's worker usually computes on CPUs bound to it, while CPUs it leaves to
other processes wait during a push (vLLM's CPU backend reserves one for its engine core, which
the bridge makes wait without spinning). Two steps of a push are independent per module or per
tensor and spend their time in kernels that release the GIL: re-deriving each linear's packed
copy (:mod:`.derived`, a oneDNN reorder on the CPU backend) and the finiteness pass over the
checkpoint (:mod:`.validate`). :func:`run_split` runs such jobs on the calling thread and on
:func:`helper_threads` more, each pinned to the spare CPUs, so a push uses them too.

Nothing runs on helpers until an integration calls :func:`set_helper_threads` in the process (the
vLLM layer does, in each bridged CPU worker: :mod:`weight_bridge.vllm.worker.cpu_threads`). The jobs
are split by cost, largest first, each to the least loaded thread; the split is the same on
every push, so a thread frees and re-allocates the same buffers each time (glibc keeps one heap
per thread).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")

_helpers = 0
_cpus: frozenset[int] = frozenset()


def set_helper_threads(helpers: int, cpus: Iterable[int]) -> None:
    """Let :func:`run_split` in this process use ``helpers`` threads besides the caller's,
    pinned to ``cpus`` (0 helpers, or no CPUs: everything on the calling thread)."""
    global _helpers, _cpus
    _cpus = frozenset(cpus)
    _helpers = max(0, int(helpers)) if _cpus else 0


def helper_threads() -> int:
    """How many helper threads :func:`run_split` uses in this process."""
    return _helpers


def _split(costs: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of ``costs`` in ``parts`` groups: largest first, each to the least loaded."""
    groups: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        least = load.index(min(load))
        groups[least].append(i)
        load[least] += costs[i]
    return groups


def run_split(
    items: Sequence[T], cost: Callable[[T], int], work: Callable[[T], R]
) -> list[R | BaseException]:
    """``work(item)`` for every item, split by ``cost`` between this thread and the helpers;
    each item's result, or the exception it raised, in the order of ``items``. Every item is
    attempted whatever another raised (a caller reports the first failure in its own order).
    Helpers run with the caller's grad mode."""
    out: list[R | BaseException] = [RuntimeError("not run")] * len(items)

    def run(indices: list[int]) -> None:
        for i in indices:
            try:
                out[i] = work(items[i])
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller per item
                out[i] = exc

    parts = min(_helpers + 1, len(items))
    if parts <= 1:
        run(list(range(len(items))))
        return out
    groups = _split([cost(item) for item in items], parts)
    grad = torch.is_grad_enabled()

    def helper(indices: list[int]) -> None:
        with contextlib.suppress(OSError):  # unpinned if the CPUs went away
            os.sched_setaffinity(0, _cpus)  # this thread only
        with torch.set_grad_enabled(grad):
            run(indices)

    threads = [threading.Thread(target=helper, args=(g,), daemon=True) for g in groups[1:]]
    for thread in threads:
        thread.start()
    try:
        run(groups[0])
    finally:
        for thread in threads:
            thread.join()
    return out
