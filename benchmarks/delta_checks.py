"""What the "delta sync" section checks on the engine (:mod:`benchmarks.delta`).

* :func:`drift`: the engine's exact fingerprint of every tensor it holds against the trainer's
  current cast (:func:`trainer_cast`);
* :func:`replay`: a delta run's files pushed again into the same engine, each delta applied
  first by vLLM's own sparse patches (:mod:`benchmarks.delta_worker`), then restored, then by
  the bridge's push: their times and the bits each leaves;
* :func:`cold_start` and :func:`against_cold`: the engine's greedy tokens and top-3 logprobs
  against a stock vLLM cold start on the trainer's final cast, :data:`SAMPLES` outputs of each
  (vLLM's bf16 CPU engine varies by a bf16 step from one run to the next: see
  :func:`against_cold`).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .config import LOGPROB_TOL
from .engines import greedy, start_stock_engine
from .stats import compare

__all__ = [
    "ENGINE_DTYPE",
    "against_cold",
    "cold_start",
    "drift",
    "replay",
    "compare_samples",
    "report_fields",
    "samples",
    "spread",
    "trainer_cast",
]

ENGINE_DTYPE = "bfloat16"
SAMPLES = 4  # greedy outputs per engine compared with a cold start (see against_cold)


def trainer_cast(module: Any) -> dict[str, Any]:
    """The trainer's current cast: every floating tensor in the engine's dtype, as the callback
    casts it (``Tensor.to``: to nearest, ties to even)."""
    import torch

    dtype = getattr(torch, ENGINE_DTYPE)
    return {
        n: t.detach().to(dtype) if t.is_floating_point() else t.detach().clone()
        for n, t in module.model.state_dict().items()
    }


def diff_floor(module: Any, reps: int = 3) -> list[float]:
    """Seconds the writer's diff takes when *nothing* changed: every tensor of ``module`` cast
    to the engine's dtype and compared, bit for bit, with a reference equal to that cast (the
    callback's own :class:`~weight_bridge.checkpoint.reference.Reference`). Any delta's save
    does at least this (it must read every value to find the few that changed), so it bounds
    what a delta save can cost against a complete sync's."""
    import torch

    from weight_bridge.checkpoint.reference import Reference

    dtype = getattr(torch, ENGINE_DTYPE)
    tensors = {n: t.detach() for n, t in module.model.state_dict().items()}
    reference = Reference()
    out = []
    for _ in range(reps):
        for name, t in tensors.items():
            reference.store(name, t, dtype)
        start = time.perf_counter()
        for name, t in tensors.items():
            reference.diff(name, t, dtype)
        out.append(time.perf_counter() - start)
    reference.clear()
    return out


def drift(engine: Any, cast: dict[str, Any]) -> dict[str, Any]:
    """The engine's exact fingerprint of every tensor it holds against the trainer's cast."""
    from weight_bridge.exact import exact_fingerprint, format_fingerprint

    (held,) = engine.fingerprints()
    differ = [n for n, fp in held.items() if fp != format_fingerprint(exact_fingerprint(cast[n]))]
    return {"tensors": len(held), "differ": differ, "equal": bool(held) and not differ}


def report_fields(report: Any) -> dict[str, Any]:
    return {
        "push_s": report.elapsed_s,
        "apply_s": report.elapsed_s - report.refresh_s,
        "repack_s": report.refresh_s,
        "preflight_s": report.preflight_s,
        "write_s": report.write_s,
        "readback_s": report.readback_s,
        "elements_written": report.changed,
        "report_delta": report.delta,
    }


def _replay_one(engine: Any, path: Path, last: bool) -> dict[str, Any]:
    """vLLM's patches of ``path`` (then restored), then the bridge's push of it."""
    rpc = engine.llm.collective_rpc
    rpc("bench_vllm_snapshot")
    t0 = time.perf_counter()
    (vllm,) = rpc("bench_vllm_patch", args=(str(path),))
    vllm["wall_s"] = time.perf_counter() - t0
    vllm["apply_wall_s"] = vllm["wall_s"] - vllm["refresh_s"]  # as the push's apply: RPC in
    engine.llm.reset_prefix_cache()
    (check,) = rpc("bench_vllm_check", args=(str(path),))
    out: dict[str, Any] = {"vllm": {**vllm, **check}}
    if last:
        out["vllm_greedy"] = samples(engine)
    (out["vllm"]["restored"],) = rpc("bench_vllm_restore")
    engine.llm.reset_prefix_cache()
    out["bridge"] = report_fields(engine.push(path))
    (held,) = engine.fingerprints()
    prints = out["vllm"].pop("fingerprints")
    out["same_bits"] = all(held.get(n) == fp for n, fp in prints.items())
    out["bridge_differs_from_vllm"] = [n for n, fp in prints.items() if held.get(n) != fp]
    return out


def replay(engine: Any, kept: list[Path], log: Callable[[str], None]) -> dict[str, Any]:
    log(f"  replay: the keyframe, then {len(kept) - 1} deltas by vLLM's patches and by the push")
    engine.push(kept[0])
    rows = [_replay_one(engine, p, i == len(kept) - 2) for i, p in enumerate(kept[1:])]
    return {"deltas": rows, "vllm_greedy": rows[-1].pop("vllm_greedy") if rows else None}


def samples(engine: Any) -> list[list]:
    """:data:`SAMPLES` greedy outputs of the engine as it is (see :func:`against_cold`)."""
    return [greedy(engine) for _ in range(SAMPLES)]


def _diff(got: list, want: list) -> float:
    d = compare(got, want)
    if not d.get("tokens_equal"):
        return float("inf")
    return float(d.get("max_logprob_diff") or 0.0)


def spread(outputs: list[list]) -> float:
    """The largest logprob difference between two outputs of one engine in the same state."""
    return max((_diff(a, b) for a in outputs for b in outputs), default=0.0)


def compare_samples(got: list[list], want: list[list]) -> dict[str, Any]:
    """``match``: every pair has the same tokens, and some pair also has the same top-3
    logprobs (within the benchmark's 1e-4): what the engine served is one of the outputs the
    cold start itself served."""
    diffs = [_diff(g, w) for g in got for w in want]
    return {
        "match": all(d < float("inf") for d in diffs) and min(diffs) <= LOGPROB_TOL,
        "tokens_equal": all(d < float("inf") for d in diffs),
        "pairs": len(diffs),
        "exact_pairs": sum(d <= LOGPROB_TOL for d in diffs),
        "min_logprob_diff": min(diffs),
        "max_logprob_diff": max(diffs),
    }


def cold_start(model_dir: Path, cast: dict[str, Any], dst: Path) -> list[list]:
    """:func:`samples` of a stock vLLM engine (bf16) on a model directory written at ``dst``
    holding ``cast``."""
    from weight_bridge.checkpoint import save_checkpoint

    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(model_dir, dst, ignore=shutil.ignore_patterns("*.safetensors*"))
    config = json.loads((model_dir / "config.json").read_text())
    tensors = dict(cast)
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)  # written once, as Hugging Face does
    save_checkpoint(tensors, dst / "model.safetensors")
    stock = start_stock_engine(dst, dtype=ENGINE_DTYPE)
    try:
        return samples(stock)
    finally:
        stock.close()
        shutil.rmtree(dst, ignore_errors=True)


def against_cold(seen: dict[str, list[list]], cold: list[list]) -> dict[str, Any]:
    """Each of ``seen``'s samples against the cold start's.

    Why samples: vLLM's bf16 CPU engine does not give the same logprobs from one run of the
    same prompts to the next (measured: a stock engine, no write in between, flips between two
    outputs one bf16 step apart at one logit), so one output against one output would fail by
    chance. The spread of each engine's own samples is recorded beside the verdict."""
    out: dict[str, Any] = {name: compare_samples(got, cold) for name, got in seen.items()}
    out["spread"] = {name: spread(got) for name, got in {**seen, "cold": cold}.items()}
    return out
