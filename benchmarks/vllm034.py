"""Benchmark section "vLLM 0.34": the bridge's pushes beside vLLM 0.34's own reloads.

    .venv-vllm034/bin/python -m benchmarks --only vllm034 --out bench/results-vllm034.json
    make bench-vllm034                                   # the same, under the 0.34 venv

For the tied model (a tiny tied Qwen2) and the MoE model (a tiny Qwen3-MoE), the models vLLM's
API is tested on (``tests/conftest.py``'s ``api_models``: A, and B =
:func:`~weight_bridge.testing.models.perturb_checkpoint` of A), four engines started on **A**, all
alive together (vLLM's default multi-process engine), and the same updates timed round-robin
(B on even rounds, A on odd ones; one untimed load of A first):

* ``bridge_direct``: :meth:`ColocatedEngine.push` with ``reload_mode="direct"`` (the default:
  the bridge writes through its own views);
* ``bridge_vllm_direct``: the same push with ``reload_mode="vllm-direct"`` (vLLM 0.34's direct
  reload writes, the bridge validates, reads back, re-derives what vLLM skips);
* ``vllm_layerwise``: vLLM's own ``LLM`` without the bridge, reloaded by vLLM's API
  (``collective_rpc("reload_weights", kwargs={"weights_path": DIR})``, vLLM's default
  layerwise mode) plus the prefix-cache reset a push also pays;
* ``vllm_direct``: the same call on a stock engine started with ``VLLM_RELOAD_MODE=direct``
  (its engine core process reads it once; the worker reports what it read). A refusal is the
  result, recorded as vLLM worded it.

Then each engine is loaded with A, then B, by its own method, and its greedy tokens and top-3
logprobs are compared with a stock cold start on B (:func:`~.stats.compare`; the first
differing token when they differ, and whether the engine still equals the cold start on A); a
refused method's engine is compared with the cold start
on A it still should serve.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .child import _environment
from .engines import api_reload, greedy, push, start_engine, start_stock_engine
from .report import _fmt_s
from .stats import Rounds, compare

__all__ = ["METHODS", "bench_vllm034", "render_vllm034"]

MODELS = {"tied": "tiny tied Qwen2", "moe": "tiny Qwen3-MoE (4 experts, top 2)"}
METHODS: dict[str, tuple[str, str]] = {  # name: (what, whose write)
    "bridge_direct": ("push, reload_mode='direct' (default)", "the bridge's"),
    "bridge_vllm_direct": ("push, reload_mode='vllm-direct'", "vLLM's direct + the bridge's"),
    "vllm_layerwise": ("stock vLLM, reload_weights (layerwise)", "vLLM's"),
    "vllm_direct": ("stock vLLM, VLLM_RELOAD_MODE=direct", "vLLM's"),
}


def build_pair(workdir: Path, kind: str) -> tuple[Path, Path]:
    """A and its perturbed B, as the tests' ``api_models`` build them."""
    from weight_bridge.testing.models import (
        build_matrix_model,
        build_tiny_model,
        perturb_checkpoint,
    )

    root = workdir / kind
    if kind == "tied":
        a = build_tiny_model(root / "A", arch="qwen2", seed=0)
    else:
        a = build_matrix_model(root / "A", "qwen3-moe", seed=0)
    return a, perturb_checkpoint(a, root / "B", scale=0.3, seed=1)


def _start(a: Path) -> dict[str, Any]:
    """The four engines on A (see the module docstring)."""
    engines: dict[str, Any] = {}
    try:
        engines["bridge_direct"] = start_engine(a)
        engines["bridge_vllm_direct"] = start_engine(a, reload_mode="vllm-direct")
        engines["vllm_layerwise"] = start_stock_engine(a)
        with _environment("VLLM_RELOAD_MODE", "direct"):
            engines["vllm_direct"] = start_stock_engine(a)
    except BaseException:
        for e in engines.values():
            e.close()
        raise
    return engines


def _loads(engines: dict[str, Any], a: Path, b: Path) -> dict[str, Callable[[int], Any]]:
    """Each method's update of its engine; round ``rep`` loads B on even rounds, A on odd."""

    def ckpt(rep: int) -> Path:
        return b if rep % 2 == 0 else a

    def pushed(name: str, mode: str) -> Callable[[int], Any]:
        e = engines[name]
        return lambda rep: push(e, ckpt(rep) / "model.safetensors", rep, mode=mode)

    def reloaded(name: str) -> Callable[[int], Any]:
        return lambda rep: api_reload(engines[name], str(ckpt(rep)))

    return {
        "bridge_direct": pushed("bridge_direct", "direct"),
        "bridge_vllm_direct": pushed("bridge_vllm_direct", "vllm-direct"),
        "vllm_layerwise": reloaded("vllm_layerwise"),
        "vllm_direct": reloaded("vllm_direct"),
    }


def first_difference(got: list, want: list) -> dict[str, Any] | None:
    """The first generated token where two :func:`~.engines.greedy` outputs differ."""
    for prompt, ((tokens, _), (expected, _)) in enumerate(zip(got, want, strict=False)):
        for step, (g, w) in enumerate(zip(tokens, expected, strict=False)):
            if g != w:
                return {"prompt": prompt, "step": step, "token": g, "cold_start_token": w}
    return None


def _check(load: Callable[[int], Any], engine: Any, cold: dict[str, list]) -> dict[str, Any]:
    """Load A then B by ``load``; the engine against the cold start on B (on A if refused)."""
    try:
        load(1)
        load(0)
    except Exception as exc:
        out: dict[str, Any] = {"equals_cold_start": None, "refused": f"{type(exc).__name__}: {exc}"}
        try:
            out["after_refusal_equals_cold_A"] = compare(greedy(engine), cold["A"])["match"]
        except Exception as gen_exc:  # the engine no longer generates
            out["after_refusal_equals_cold_A"] = f"{type(gen_exc).__name__}: {gen_exc}"
        return out
    got = greedy(engine)
    out = compare(got, cold["B"])
    out["equals_cold_start"] = out["match"]
    out["first_difference"] = first_difference(got, cold["B"])
    out["equals_cold_start_on_A"] = compare(got, cold["A"])["match"]  # nothing taken at all?
    return out


def bench_model(kind: str, workdir: Path, reps: int, log: Callable[[str], None]) -> dict:
    """One model's four methods: timings round-robin, then the cold-start checks."""
    a, b = build_pair(workdir, kind)
    out: dict[str, Any] = {"model": MODELS[kind], "reps": reps, "methods": {}}
    cold: dict[str, list] = {}
    for tag, path in (("A", a), ("B", b)):
        stock = start_stock_engine(path)
        try:
            cold[tag] = greedy(stock)
        finally:
            stock.close()
    out["a_differs_from_b"] = cold["A"] != cold["B"]
    log(f"{kind}: four engines on A")
    engines = _start(a)
    try:
        out["vllm_direct_engine"] = engines["vllm_direct"].llm.collective_rpc("bench_reload_mode")
        loads = _loads(engines, a, b)
        for load in loads.values():  # untimed: first-call costs stay out of the rounds
            with contextlib.suppress(Exception):
                load(1)
        log(f"{kind}: timed rounds ({reps} x {len(loads)})")
        rounds = Rounds()
        rounds.run(loads, reps)
        log(f"{kind}: each method A -> B against a cold start on B")
        for name, load in loads.items():
            out["methods"][name] = {"time": rounds.result(name)}
            out["methods"][name].update(_check(load, engines[name], cold))
    finally:
        for e in engines.values():
            e.close()
    return out


def bench_vllm034(workdir: Path, reps: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Both models (vLLM's multi-process engine: each engine core reads its env at start)."""
    import vllm

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    section: dict[str, Any] = {"vllm": vllm.__version__, "models": {}}
    try:
        for kind in MODELS:
            try:
                section["models"][kind] = bench_model(kind, workdir, reps, log)
            except Exception as exc:  # recorded; the other model still runs
                section["models"][kind] = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        shutil.rmtree(workdir / "tied", ignore_errors=True)
        shutil.rmtree(workdir / "moe", ignore_errors=True)
    return section


def _cells(m: dict[str, Any]) -> tuple[str, str]:
    """(time, equals the cold start) of one method's result."""
    if m.get("refused"):
        kept = m.get("after_refusal_equals_cold_A") is True
        served = "still equals the cold start on A" if kept else "A NOT kept"
        return "refused", f"refused ({served}): {m['refused']}"
    if m.get("equals_cold_start"):
        return _fmt_s(m["time"]), "True"
    d = m.get("first_difference")
    where = (
        f"prompt {d['prompt']} step {d['step']}: token {d['token']}, cold start "
        f"{d['cold_start_token']}"
        if d
        else f"same tokens, logprobs differ by {m.get('max_logprob_diff', 0):.3g}"
    )
    on_a = "equals" if m.get("equals_cold_start_on_A") else "differs from"
    return _fmt_s(m["time"]), f"False ({where}; {on_a} the cold start on A)"


def render_vllm034(section: dict[str, Any]) -> str:
    """The section as a markdown table: time median [min–max] and the cold-start verdict."""
    lines = [
        f"## vLLM {section.get('vllm', '0.34')}: the bridge's pushes beside vLLM's own reloads",
        "",
        "| model | method | whose write | s, median [min–max] | equals a cold start on B |",
        "|---|---|---|---|---|",
    ]
    for kind, model in section.get("models", {}).items():
        if "error" in model:
            lines.append(f"| {kind} | error: {model['error']} | | | |")
            continue
        for name, m in model["methods"].items():
            what, whose = METHODS[name]
            time_cell, verdict = _cells(m)
            lines.append(f"| {kind} | {what} | {whose} | {time_cell} | {verdict} |")
    return "\n".join(lines) + "\n"
