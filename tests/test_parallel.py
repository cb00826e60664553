"""A push's split jobs (weight_bridge.direct.parallel): order, failures, threads, CPUs."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from weight_bridge.direct import DirectReloadError
from weight_bridge.direct.derived import refresh_derived_state
from weight_bridge.direct.parallel import helper_threads, run_split, set_helper_threads
from weight_bridge.direct.state import bridge_state
from weight_bridge.direct.validate import find_nonfinite

CPUS = sorted(os.sched_getaffinity(0))


@pytest.fixture
def helpers() -> Iterator[None]:
    """One helper thread pinned to the last CPU of this process; none again afterwards."""
    set_helper_threads(1, CPUS[-1:])
    yield
    set_helper_threads(0, ())


def test_without_helpers_everything_runs_on_the_calling_thread() -> None:
    assert helper_threads() == 0
    seen = run_split(list(range(5)), lambda i: 1, lambda i: threading.get_ident())
    assert seen == [threading.get_ident()] * 5


def test_results_come_back_in_order_and_failures_per_item(helpers) -> None:
    def work(i: int) -> int:
        if i == 3:
            raise ValueError("three")
        return i * i

    out = run_split(list(range(8)), lambda i: 8 - i, work)
    assert [o for i, o in enumerate(out) if i != 3] == [0, 1, 4, 16, 25, 36, 49]
    assert isinstance(out[3], ValueError) and str(out[3]) == "three"


def test_a_helper_runs_part_of_the_jobs_pinned_to_the_spare_cpus(helpers) -> None:
    def work(i: int) -> tuple[int, frozenset[int]]:
        time.sleep(0.01)  # long enough that both threads take jobs
        return threading.get_ident(), frozenset(os.sched_getaffinity(0))

    out = run_split(list(range(6)), lambda i: 1, work)
    threads = {t for t, _ in out}  # type: ignore[misc]
    assert len(threads) == 2 and threading.get_ident() in threads
    pinned = {cpus for t, cpus in out if t != threading.get_ident()}  # type: ignore[misc]
    assert pinned == {frozenset(CPUS[-1:])}
    assert os.sched_getaffinity(0) == set(CPUS)  # the caller's own CPUs are left alone


def test_jobs_are_split_by_cost(helpers) -> None:
    costs = [100, 1, 1, 1, 1, 1, 1, 1, 1, 1]

    def work(i: int) -> int:
        return threading.get_ident()

    out = run_split(list(range(len(costs))), lambda i: costs[i], work)
    big = out[0]
    assert all(o != big for o in out[1:])  # the big job alone on one thread, the rest on the other


def test_helpers_run_with_the_callers_grad_mode(helpers) -> None:
    with torch.no_grad():
        out = run_split(list(range(4)), lambda i: 1, lambda i: torch.is_grad_enabled())
    assert out == [False] * 4


def test_finiteness_pass_split_across_threads_names_each_tensor(helpers) -> None:
    items = [(f"w{i}", torch.randn(64, 64)) for i in range(6)]
    items[1][1][0, 0] = float("nan")
    items[4][1][3, 3] = float("inf")
    bad = find_nonfinite(items)
    assert bad == {"w1": "holds 1 NaN and 0 Inf values", "w4": "holds 0 NaN and 1 Inf values"}


class _Refresher:
    kind = "test refresher"
    explains = frozenset()
    sources: dict = {}
    concurrent = True

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.threads: list[int] = []

    def refresh(self, module: torch.nn.Module) -> None:
        self.threads.append(threading.get_ident())
        time.sleep(0.01)
        if self.fail:
            raise RuntimeError("kernel refused")


def _model(refreshers: dict[str, _Refresher]) -> torch.nn.Module:
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in refreshers))
    bridge_state(model).refreshers = dict(refreshers)  # type: ignore[assignment]
    return model


def test_concurrent_refreshers_run_side_by_side(helpers) -> None:
    refreshers = {str(i): _Refresher() for i in range(4)}
    done = refresh_derived_state(_model(refreshers), list(refreshers))
    assert done == {name: "test refresher" for name in refreshers}
    assert len({t for r in refreshers.values() for t in r.threads}) == 2


def test_a_failed_concurrent_refresh_names_its_module_and_leaves_the_model_undefined(
    helpers,
) -> None:
    refreshers = {str(i): _Refresher(fail=i in (2, 3)) for i in range(4)}
    model = _model(refreshers)
    with pytest.raises(DirectReloadError, match="refreshing the test refresher of 2 after"):
        refresh_derived_state(model, list(refreshers))
    assert "kernel refused" in (bridge_state(model).undefined or "")
    assert all(r.threads for r in refreshers.values())  # every refresh was attempted
