"""The lock around an LLMClient's calls: first come, first served (fast, no engine)."""

from __future__ import annotations

import threading
import time

from weight_bridge.vllm.clients.fair_lock import FairLock
from weight_bridge.vllm.clients.llm import LLMClient


def _waiting_until_queued(lock: FairLock, target, n: int = 1) -> list[threading.Thread]:
    threads = [threading.Thread(target=target) for _ in range(n)]
    for t in threads:
        t.start()
        deadline = time.monotonic() + 5
        while len(lock._waiting) < threads.index(t) + 1:  # each queued before the next starts
            assert time.monotonic() < deadline
            time.sleep(0.001)
    return threads


def test_a_thread_that_releases_and_asks_again_queues_behind_the_waiting_one():
    """The pattern that starved a generate behind a pushing thread: release, then at once ask
    again. The thread already waiting gets the lock first."""
    lock, order = FairLock(), []

    def waiter() -> None:
        with lock:
            order.append("waiter")

    lock.acquire()
    (t,) = _waiting_until_queued(lock, waiter)
    for _ in range(3):
        lock.release()
        lock.acquire()
        order.append("releaser")
    lock.release()
    t.join(5)
    assert order == ["waiter", "releaser", "releaser", "releaser"]


def test_waiters_get_the_lock_in_the_order_they_asked():
    lock, order = FairLock(), []
    names = iter(range(4))

    def waiter() -> None:
        me = next(names)
        with lock:
            order.append(me)

    lock.acquire()
    threads = _waiting_until_queued(lock, waiter, 4)
    lock.release()
    for t in threads:
        t.join(5)
    assert order == [0, 1, 2, 3]


def test_reentrant_timeout_and_release_by_the_owner_only():
    lock = FairLock()
    with lock, lock:  # the holder asks again: no deadlock
        got: list[bool] = []
        other = threading.Thread(target=lambda: got.append(lock.acquire(timeout=0.05)))
        other.start()
        other.join(5)
        assert got == [False] and not lock._waiting  # a timed-out ticket leaves the queue
        assert lock.acquire(blocking=False)
        lock.release()
    assert lock.acquire(timeout=0)  # free after as many releases as acquires
    refused: list[BaseException] = []

    def stranger() -> None:
        try:
            lock.release()
        except RuntimeError as exc:
            refused.append(exc)

    t = threading.Thread(target=stranger)
    t.start()
    t.join(5)
    assert len(refused) == 1
    lock.release()


def test_the_llm_client_serves_its_calls_first_come_first_served():
    client = LLMClient(llm=None)
    assert isinstance(client._lock, FairLock)
