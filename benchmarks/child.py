"""The multi-process engine's measurements, in a child process (vLLM reads
``VLLM_ENABLE_V1_MULTIPROCESSING`` once per process).

On the default engine (``cpu_linear="repack"``, on A): every measurement of
:func:`~.measure.measure_engine`, the partial pushes (:mod:`.partial`) and, with ``--http``, the
same push through a ``vllm serve`` process (:mod:`.serve`). Then, where generation speed is
measured, more engines, all alive together:

* ``torch``: the bridge with ``cpu_linear="torch"``;
* ``repack_glibc_malloc``: the default bridge in processes started with
  ``WEIGHT_BRIDGE_MALLOC=default`` (glibc's own allocator, dynamic thresholds and all): the
  allocator lever against a fresh process, not a switched one;
* ``stock``: vLLM's own ``LLM``, without the bridge: vLLM's own speed, and vLLM's own
  checkpoint-format reload through its API on vLLM's own engine. It starts on **A** and is
  reloaded with B, then compared with a stock cold start on B (a short-lived engine started
  and closed first): started on B, a reload of B could not fail, whatever the reload leaves
  stale.

Pushes and reloads of those engines run round-robin; generation speed runs round-robin
across every engine.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from weight_bridge.vllm.worker.allocator import ALLOCATOR_ENV

from .config import DEFAULT_CPU_LINEAR, GEN_BATCH, GLIBC, OTHER_CPU_LINEAR
from .engines import (
    api_reload,
    gen_call,
    generation_rate,
    greedy,
    push,
    start_engine,
    start_stock_engine,
)
from .machine import descendants, proc_name
from .measure import measure_engine
from .partial import measure_partial
from .serve import measure_http
from .stats import Rounds, compare

__all__ = ["child_multiprocess"]


def _log(msg: str) -> None:
    print(f"[bench child] {msg}", flush=True)


@contextlib.contextmanager
def _environment(key: str, value: str) -> Iterator[None]:
    before = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def child_multiprocess(spec: dict[str, Any]) -> dict[str, Any]:
    """See the module docstring; ``spec``: ``a``, ``b``, ``reps``, ``gen``, ``http``."""
    a, b, reps = Path(spec["a"]), Path(spec["b"]), int(spec["reps"])
    engine = start_engine(a)
    engines: dict[str, Any] = {DEFAULT_CPU_LINEAR: engine}
    try:
        # The engine's processes (engine core, worker) are this process's descendants.
        pids = descendants(os.getpid())
        out = measure_engine(engine, a, b, reps, pids, _log)
        out["partial"] = measure_partial(engine, a, b, a.parent, reps, _log)
        out["process_names"] = [proc_name(p) for p in pids]
        out["worker_pids"] = engine.llm.collective_rpc("bench_pid")
        if spec.get("http"):
            out["http"] = _guarded(lambda: measure_http(engine, a, b, reps, _log))
        if spec.get("gen"):
            _log(f"  more engines: {OTHER_CPU_LINEAR} and {GLIBC} on B, stock vLLM on A")
            engines.update(_more_engines(a, b, out))
            out.update(_pushes_elsewhere(engines, a, b, reps, out))
            out["generation"] = _generation(engines, spec["gen"])
    finally:
        for e in engines.values():
            e.close()
    return out


def _guarded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A section whose failure is recorded, not fatal to the rest of the child."""
    import traceback

    try:
        return fn()
    except Exception as exc:
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"}


def _more_engines(a: Path, b: Path, out: dict[str, Any]) -> dict[str, Any]:
    """The bridged engines on B; vLLM's own engine on A, reloaded with B by its own API and
    compared with a stock cold start on B."""
    cold = start_stock_engine(b)
    try:
        stock_cold_b = greedy(cold)
    finally:
        cold.close()
    engines: dict[str, Any] = {OTHER_CPU_LINEAR: start_engine(b, cpu_linear=OTHER_CPU_LINEAR)}
    with _environment(ALLOCATOR_ENV, "default"):
        engines[GLIBC] = start_engine(b)
    engines["stock"] = start_stock_engine(a)
    for mode, e in engines.items():
        out[f"engine_{mode}"] = {"startup_s": e.startup_s}
        if mode != "stock":
            out[f"engine_{mode}"]["cold_B"] = greedy(e)
    stock = out["engine_stock"]
    stock["started_on"], stock["cold_B"] = "A", stock_cold_b
    stock["cold_A"] = greedy(engines["stock"])
    api_reload(engines["stock"], str(b))  # A -> B by vLLM's own reload, before any timing
    stock["parity_own_reload_a_to_b"] = compare(greedy(engines["stock"]), stock_cold_b)
    stock["a_differs_from_b"] = stock["cold_A"] != stock_cold_b
    return engines


def _pushes_elsewhere(
    engines: dict[str, Any], a: Path, b: Path, reps: int, out: dict[str, Any]
) -> dict[str, Any]:
    """Round-robin: a push into each bridged engine, vLLM's own reload into the stock one;
    then the parity of each pushed engine with its own cold start."""
    fa, fb = a / "model.safetensors", b / "model.safetensors"

    def file(rep: int) -> Path:
        return fb if rep % 2 == 0 else fa

    def folder(rep: int) -> str:
        return str(b if rep % 2 == 0 else a)

    methods: dict[str, Callable[[int], Any]] = {
        mode: (lambda rep, e=engines[mode]: push(e, file(rep), rep))
        for mode in (DEFAULT_CPU_LINEAR, GLIBC, OTHER_CPU_LINEAR)
    }
    methods["stock_api_reload"] = lambda rep: api_reload(engines["stock"], folder(rep))
    _log(f"  pushes into each engine, round-robin ({reps} x {len(methods)})")
    rounds = Rounds()
    rounds.run(methods, reps)
    extra: dict[str, Any] = {"pushes_elsewhere": {n: rounds.result(n) for n in methods}}
    for mode in (GLIBC, OTHER_CPU_LINEAR):
        pushed = engines[mode]
        pushed.push(fa, version="A")
        pushed.push(fb, version="B")
        cold = out[f"engine_{mode}"]["cold_B"]
        out[f"engine_{mode}"]["parity_vs_own_cold"] = compare(greedy(pushed), cold)
    out["engine_stock"]["cold_vs_repack_pushed"] = compare(
        out["engine_stock"]["cold_B"], out["outputs"]["direct"]
    )
    return extra


def _generation(engines: dict[str, Any], gen: list[int]) -> dict[str, Any]:
    _log(f"  generation speed, interleaved across {len(engines)} engines")
    tokens, gen_reps = int(gen[0]), int(gen[1])
    for e in engines.values():  # warm-up: first-batch costs stay out of the timing
        generation_rate(e, 2)
    rounds = Rounds()
    rounds.run({mode: gen_call(e, tokens) for mode, e in engines.items()}, gen_reps)
    return {
        "batch": GEN_BATCH,
        "max_tokens": tokens,
        "engine": "multi-process, enforce_eager=True",
        **{mode: {"tokens_per_s": rounds.result(mode)} for mode in engines},
    }
