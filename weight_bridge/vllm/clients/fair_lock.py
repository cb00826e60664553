"""A re-entrant lock that threads get in the order they asked for it.

A ``vllm.LLM`` serves one call at a time, so :class:`~weight_bridge.vllm.clients.llm.LLMClient`
holds a lock around each push and each generate. ``threading.RLock`` lets the thread that releases
it take it back at once, ahead of threads already waiting: a trainer thread that pushes in a loop
(or two of them) can then keep a rollout thread from generating for many pushes, and the rollouts it
finally serves skip versions. Handed over first come, first served, a waiting generate runs before
the next push of a thread that just pushed.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from types import TracebackType


class FairLock:
    """Re-entrant; ``acquire(timeout=...)`` like ``threading.RLock``; first come, first served."""

    def __init__(self) -> None:
        self._state = threading.Condition(threading.Lock())
        self._waiting: deque[object] = deque()  # one ticket per waiting thread, first = next
        self._owner: int | None = None
        self._depth = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = threading.get_ident()
        with self._state:
            if self._owner == me:
                self._depth += 1
                return True
            if self._owner is None and not self._waiting:
                self._owner, self._depth = me, 1
                return True
            if not blocking:
                return False
            ticket = object()
            self._waiting.append(ticket)
            deadline = None if timeout < 0 else time.monotonic() + timeout
            try:
                while self._owner is not None or self._waiting[0] is not ticket:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._state.wait(left)
                self._owner, self._depth = me, 1
                return True
            finally:
                self._waiting.remove(ticket)
                self._state.notify_all()  # the next ticket may be first now

    def release(self) -> None:
        with self._state:
            if self._owner != threading.get_ident():
                raise RuntimeError("cannot release a lock this thread does not hold")
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._state.notify_all()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()
