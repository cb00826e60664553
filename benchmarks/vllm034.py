"""Section "vllm034" (the 0.34 venv): the bridge's two push modes beside vLLM 0.34's own
reloads on a tied and a MoE model, timed round-robin, each against a cold start."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .engines import StockEngine, alternate, api_reload, greedy, push, start_engine
from .harness import MULTIPROCESSING, Log, Rounds, compare, environment, logger, spread, table

# fmt: off
MODELS = {"tied": "tiny tied Qwen2", "moe": "tiny Qwen3-MoE (4 experts, top 2)"}
METHODS: dict[str, tuple[str, str]] = {  # name: (what, whose write)
    "bridge_direct": ("push, reload_mode='direct' (default)", "the bridge's"),
    "bridge_vllm_direct": ("push, reload_mode='vllm-direct'", "vLLM's direct + the bridge's"),
    "vllm_layerwise": ("stock vLLM, reload_weights (layerwise)", "vLLM's"),
    "vllm_direct": ("stock vLLM, VLLM_RELOAD_MODE=direct", "vLLM's")}

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
    out = compare(got := greedy(engine), cold["B"])
    out["equals_cold_start"] = out["match"]
    out["first_difference"] = next((
        {"prompt": prompt, "step": step, "token": g, "cold_start_token": w}
        for prompt, ((tokens, _), (want, _)) in enumerate(zip(got, cold["B"], strict=False))
        for step, (g, w) in enumerate(zip(tokens, want, strict=False)) if g != w), None)
    out["equals_cold_start_on_A"] = compare(got, cold["A"])["match"]  # nothing taken at all?
    return out

def bench_model(kind: str, workdir: Path, reps: int, log: Log) -> dict[str, Any]:
    from weight_bridge.testing import models
    root = workdir / kind
    if kind == "tied":
        a = models.build_tiny_model(root / "A", arch="qwen2", seed=0)
    else:
        a = models.build_matrix_model(root / "A", "qwen3-moe", seed=0)
    b = models.perturb_checkpoint(a, root / "B", scale=0.3, seed=1)
    out: dict[str, Any] = {"model": MODELS[kind], "reps": reps, "methods": {}}
    cold: dict[str, list] = {}
    for tag, path in (("A", a), ("B", b)):
        with contextlib.closing(StockEngine(path)) as stock:
            cold[tag] = greedy(stock)
    out["a_differs_from_b"] = cold["A"] != cold["B"]
    log(f"{kind}: four engines on A")
    engines: dict[str, Any] = {}
    try:
        engines["bridge_direct"] = start_engine(a)
        engines["bridge_vllm_direct"] = start_engine(a, reload_mode="vllm-direct")
        engines["vllm_layerwise"] = StockEngine(a)
        with environment(VLLM_RELOAD_MODE="direct"):  # its engine core reads it at start
            engines["vllm_direct"] = StockEngine(a)
        out["vllm_direct_engine"] = engines["vllm_direct"].llm.collective_rpc("bench_reload_mode")
        ckpt = alternate(b, a)  # B on even rounds, A on odd ones
        modes = {"bridge_direct": "direct", "bridge_vllm_direct": "vllm-direct"}
        loads = {name: (lambda rep, e=engines[name], m=mode: push(
            e, ckpt(rep) / "model.safetensors", rep, mode=m)) for name, mode in modes.items()}
        loads.update({name: (lambda rep, e=engines[name]: api_reload(e, ckpt(rep)))
                      for name in ("vllm_layerwise", "vllm_direct")})
        for load in loads.values():  # untimed: first-call costs stay out of the rounds
            with contextlib.suppress(Exception):
                load(1)
        log(f"{kind}: timed rounds ({reps} x {len(loads)})")
        rounds = Rounds(loads, reps)
        log(f"{kind}: each method A -> B against a cold start on B")
        for name, load in loads.items():
            checked = _check(load, engines[name], cold)
            out["methods"][name] = {"time": rounds.result(name), **checked}
    finally:
        for e in engines.values():
            e.close()
    return out

def section(args: Any, workdir: Path) -> dict[str, Any]:
    import vllm
    os.environ[MULTIPROCESSING] = "1"
    result: dict[str, Any] = {"vllm": vllm.__version__, "models": {}}
    for kind in MODELS:
        try:
            result["models"][kind] = bench_model(kind, workdir, args.reps, logger("vllm034"))
        except Exception as exc:  # recorded; the other model still runs
            result["models"][kind] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            shutil.rmtree(workdir / kind, ignore_errors=True)
    return result

def render(result: dict[str, Any]) -> str:
    """Per method: time median [min–max] and its verdict against the cold start."""
    rows = []
    for kind, model in result.get("models", {}).items():
        if "error" in model:
            rows.append([kind, f"error: {model['error']}", "", "", ""])
        for name, m in model.get("methods", {}).items():
            d, on_a = m.get("first_difference"), m.get("equals_cold_start_on_A")
            if m.get("refused"):
                kept = m.get("after_refusal_equals_cold_A") is True
                served = "still equals the cold start on A" if kept else "A NOT kept"
                cells = ["refused", f"refused ({served}): {m['refused']}"]
            elif m.get("equals_cold_start"):
                cells = [spread(m["time"]), "True"]
            else:
                where = (f"prompt {d['prompt']} step {d['step']}: token {d['token']}, cold start "
                         f"{d['cold_start_token']}" if d else "same tokens, logprobs differ by "
                         f"{m.get('max_logprob_diff', 0):.3g}")
                on_a = "equals" if on_a else "differs from"
                cells = [spread(m["time"]), f"False ({where}; {on_a} the cold start on A)"]
            rows.append([kind, *METHODS[name], *cells])
    title = f"## vLLM {result.get('vllm', '0.34')}: the bridge's pushes beside vLLM's own reloads"
    return "\n".join([title, "", *table(["model", "method", "whose write", "s, median [min–max]",
                                         "equals a cold start on B"], rows)]) + "\n"
# fmt: on
