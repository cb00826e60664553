"""A bridged CPU worker and the CPUs around it: it sleeps when idle, and its pushes use the CPUs
vLLM leaves spare.

vLLM's worker waits for its next message spinning on a CPU for a second after the last one
(``SpinCondition``), to start each engine step a few microseconds sooner. Colocated with a
trainer on a CPU machine, that second is taken from the trainer after every generation step
and every call (a push's, for one): the trainer's next step and its next save run on a CPU
less. :func:`sleep_when_idle` makes a bridged CPU worker spin for :data:`IDLE_AFTER_S` only and
then wait asleep; the engine core waits asleep at once for its workers' reply to a push
(:mod:`~weight_bridge.vllm.core.updates`). The queue's writer wakes a sleeper with a notification
after every message, but vLLM's notification socket may drop one sent soon after another (vLLM's own
sleeper re-checks every 5 s for that reason), so a wait asleep sooner than vLLM meant re-checks
the queue every :data:`RECHECK_MS` instead: a dropped wake-up costs at most that. :func:`idle_wait`
is the wrapper of vLLM's wait the plugin installs; it changes only waits shortened this way.

vLLM's CPU backend starts its workers with their OpenMP threads bound to their CPUs
(``VLLM_CPU_OMP_THREADS_BIND``, ``auto`` by default) and keeps the rest of the CPUs its parent
process may use for the engine core and the frontend (one per worker by default,
``VLLM_CPU_NUM_OF_RESERVED_CPU``). While a push runs, nothing needs them: the trainer waits for
the push, generation waits for the weights, and the engine core waits for the workers asleep.

:func:`use_spare_cpus` gives each worker an equal share of those CPUs (``len(spare) //
workers``) as helper threads for its pushes (:mod:`weight_bridge.direct.parallel`: the linears'
oneDNN re-pack and the finiteness pass, split across threads). Only a worker that computes
with one OpenMP thread gets helpers by default: a worker with more already spreads those
kernels over its CPUs, and each helper would start its own OpenMP team on those same CPUs.
``WEIGHT_BRIDGE_PUSH_THREADS=N`` sets the number of helpers instead (``0``: none); they are still
pinned to the spare CPUs, so a worker without any gets none.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from ...direct.parallel import helper_threads, set_helper_threads
from ..internals.objects import set_spin_window, spin_window

PUSH_THREADS_ENV = "WEIGHT_BRIDGE_PUSH_THREADS"
# A bridged CPU worker spins this long after a message (vLLM: 1 s), then sleeps. Not 0: within
# a burst of messages (generation steps) a reader that spins starts each one sooner than one
# woken by the socket. (The engine core waits for a push's one reply asleep at once.)
IDLE_AFTER_S = 0.01
# How often a reader asleep re-checks its queue (vLLM's sleeper: every 5 s), for the wake-ups
# the notification socket drops; 200 wake-ups a second cost well under 1 % of a CPU.
RECHECK_MS = 5
_sleeping = False


def sleep_when_idle() -> None:
    """From now on, this process's message-queue readers wait asleep (see the docstring)."""
    global _sleeping
    _sleeping = True


def idle_wait(original: Callable[..., None]) -> Callable[..., None]:
    """vLLM's ``SpinCondition.wait``, its busy loop cut to :data:`IDLE_AFTER_S` once
    :func:`sleep_when_idle` ran; a wait whose busy loop is that short (this one's, or the engine
    core's during a push) sleeps at most :data:`RECHECK_MS` before it re-checks the queue."""

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        if _sleeping and spin_window(self) > IDLE_AFTER_S:
            set_spin_window(self, IDLE_AFTER_S)
        if spin_window(self) <= IDLE_AFTER_S:
            timeout_ms = RECHECK_MS if timeout_ms is None else min(timeout_ms, RECHECK_MS)
        return original(self, timeout_ms)

    return wait


def spare_cpus() -> set[int]:
    """The CPUs this process's parent may use and this process may not (empty if unknown)."""
    try:
        return set(os.sched_getaffinity(os.getppid())) - set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set()


def _workers() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def use_spare_cpus() -> int:
    """Give this worker's pushes their share of the spare CPUs (see the module docstring);
    the number of helper threads."""
    spare = spare_cpus()
    asked = os.environ.get(PUSH_THREADS_ENV, "").strip()
    if asked:
        helpers = int(asked)
    elif torch.get_num_threads() == 1:
        helpers = len(spare) // _workers()
    else:
        helpers = 0
    set_helper_threads(helpers, spare)
    return helper_threads()
