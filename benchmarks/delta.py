"""Section "delta": a real Trainer's deltas into a bf16 engine against complete syncs, the
engine's bits against the trainer's, vLLM's sparse patches on the same deltas, a cold start."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from weight_bridge.checkpoint import save_checkpoint
from weight_bridge.delta.reference import Reference
from weight_bridge.exact import exact_fingerprint, format_fingerprint

from . import harness
from .engines import StockEngine, greedy, start_engine
from .harness import Log, compare, fmt, logger, ratio, spread, stats, table, verdict
from .sync import measured_sync, report_fields

# fmt: off
ENGINE_DTYPE, SAMPLES = "bfloat16", 4  # greedy outputs per engine against a cold start
BYTES_LR = 1e-6  # the bytes target's lr
TARGETS: dict[str, tuple[str, Any, str]] = {
    "bytes": ("<=", 0.10, "largest delta file / median complete bf16 file, at lr 1e-6"),
    "save_apply": ("<=", 0.25, "delta sync's save + apply (push minus CPU re-pack) / complete "
                   "bf16 sync's save + write (push minus CPU re-pack), medians over the syncs"),
    "vllm_patches": (">=", 3.0, "vLLM's load_checkpoint_weight_patches (in the worker, RPC "
                     "included, re-pack excluded) / the bridge's apply (push minus re-pack), same "
                     "delta, same engine, medians"),
    "zero_drift": ("==", True, "after every sync the engine's exact fingerprints equal the "
                   "trainer's bf16 cast, and after the last delta a stock cold start on that cast "
                   "equals the engine (greedy tokens; top-3 logprobs of one of 4 runs each, as "
                   "vLLM's bf16 runs vary)")}
KEYS = ("save_s", "push_s", "apply_s", "repack_s", "preflight_s", "write_s", "readback_s")

def trainer_cast(module: Any) -> dict[str, Any]:
    """Every floating tensor in the engine's dtype, as the callback casts it (to nearest)."""
    dtype = getattr(torch, ENGINE_DTYPE)
    return {n: t.detach().to(dtype) if t.is_floating_point() else t.detach().clone()
            for n, t in module.model.state_dict().items()}

def drift(engine: Any, cast: dict[str, Any]) -> dict[str, Any]:
    """The engine's exact fingerprint of every tensor it holds against the trainer's cast."""
    (held,) = engine.fingerprints()
    differ = [n for n, fp in held.items() if fp != format_fingerprint(exact_fingerprint(cast[n]))]
    return {"tensors": len(held), "differ": differ, "equal": bool(held) and not differ}

def samples(engine: Any) -> list[list]:
    return [greedy(engine) for _ in range(SAMPLES)]

def replay(engine: Any, kept: list[Path], log: Log) -> dict[str, Any]:
    """The keyframe, then per delta vLLM's patches (then undone) and the bridge's push."""
    log(f"  replay: the keyframe, then {len(kept) - 1} deltas by vLLM's patches and by the push")
    engine.push(kept[0])
    rows, rpc = [], engine.llm.collective_rpc
    for i, path in enumerate(kept[1:]):
        rpc("bench_vllm_snapshot")
        t0 = time.perf_counter()
        (vllm,) = rpc("bench_vllm_patch", args=(str(path),))
        vllm["wall_s"] = time.perf_counter() - t0
        vllm["apply_wall_s"] = vllm["wall_s"] - vllm["refresh_s"]  # as the push's apply: RPC in
        engine.llm.reset_prefix_cache()
        (check,) = rpc("bench_vllm_check", args=(str(path),))
        out: dict[str, Any] = {"vllm": {**vllm, **check}}
        if i == len(kept) - 2:
            out["vllm_greedy"] = samples(engine)
        (out["vllm"]["restored"],) = rpc("bench_vllm_restore")
        engine.llm.reset_prefix_cache()
        out["bridge"] = report_fields(engine.push(path))
        (held,) = engine.fingerprints()
        prints = out["vllm"].pop("fingerprints")
        out["same_bits"] = all(held.get(n) == fp for n, fp in prints.items())
        out["bridge_differs_from_vllm"] = [n for n, fp in prints.items() if held.get(n) != fp]
        rows.append(out)
    return {"deltas": rows, "vllm_greedy": rows[-1].pop("vllm_greedy") if rows else None}

def against_cold(seen: dict[str, list[list]], model: Path, cast: dict, dst: Path) -> dict:
    """``seen``'s samples against a stock cold start's on ``cast``: every pair's tokens equal,
    some pair's top-3 logprobs (it served one of the cold start's outputs); each one's spread."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(model, dst, ignore=shutil.ignore_patterns("*.safetensors*"))
    tensors = dict(cast)
    if json.loads((model / "config.json").read_text()).get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)  # written once, as Hugging Face does
    save_checkpoint(tensors, dst / "model.safetensors")
    stock = StockEngine(dst, dtype=ENGINE_DTYPE)
    try:
        cold = samples(stock)
    finally:
        stock.close()
        shutil.rmtree(dst, ignore_errors=True)

    def diff(got: list, want: list) -> float:
        d = compare(got, want)
        return float(d.get("max_logprob_diff") or 0.0) if d.get("tokens_equal") else float("inf")
    out, tol = {}, harness.LOGPROB_TOL
    for name, got in seen.items():
        diffs = [diff(g, w) for g in got for w in cold]
        same = all(d < float("inf") for d in diffs)
        out[name] = {"match": same and min(diffs) <= tol, "tokens_equal": same, "pairs": len(diffs),
                     "exact_pairs": sum(d <= tol for d in diffs), "min_logprob_diff": min(diffs),
                     "max_logprob_diff": max(diffs)}
    out["spread"] = {n: max((diff(a, b) for a in got for b in got), default=0.0)
                     for n, got in {**seen, "cold": cold}.items()}
    return out

def _fit(model: Path, root: Path, steps: int, lr: float, engine: Any, delta: bool) -> Any:
    """One run, a sync at train start and after each step: deltas (files kept, the engine
    checked against the cast after each sync), or complete."""
    from lightning.pytorch.callbacks import Callback

    from callbacks import CheckpointNames, Schedule
    keep = root / f"kept-{lr:g}" if delta else None
    if keep is not None:
        shutil.rmtree(keep, ignore_errors=True)
        keep.mkdir(parents=True)
    schedule = Schedule(every_n_train_steps=1, skip_frozen=False, delta="on" if delta else "off")
    sync = measured_sync(record=True, keep=keep, engine=engine, schedule=schedule,
                         names=CheckpointNames(dtype="engine"))
    sync.drift = []

    class DriftCheck(Callback):  # after each sync (the next callback in the list)
        def check(self, pl_module: Any) -> None:
            if len(sync.history) > len(sync.drift):
                step = sync.history[-1]["step"]
                sync.drift.append({"step": step, **drift(engine, trainer_cast(pl_module))})

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.check(pl_module)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            self.check(pl_module)

    module = harness.policy(model, lr, tokens=16, batch=4)
    harness.fit(module, [sync, DriftCheck()] if delta else [sync], steps, root)
    keys = ("step", "bytes", "delta", "changed", "save_s")  # each sync with its push's report
    records = [{**{k: h[k] for k in keys}, **sync.pushes.get(h["step"], {})} for h in sync.history]
    return sync, module, records

def _run_lr(model: Path, root: Path, steps: int, lr: float, engine: Any, log: Log) -> dict:
    """The delta run, its checks and replay, then the complete run; the diff alone, unchanged."""
    log(f"  lr {lr:g}: delta run ({steps} steps)")
    sync, module, records = _fit(model, root, steps, lr, engine, delta=True)
    out: dict[str, Any] = {"lr": lr, "delta": records, "drift": sync.drift, "diff_floor_s": []}
    dtype, reference = getattr(torch, ENGINE_DTYPE), Reference()  # the callback's own
    tensors = {n: t.detach() for n, t in module.model.state_dict().items()}
    for _ in range(3):
        for name, t in tensors.items():
            reference.store(name, t, dtype)
        start = time.perf_counter()
        for name, t in tensors.items():
            reference.diff(name, t, dtype)
        out["diff_floor_s"].append(time.perf_counter() - start)
    reference.clear()
    cast, seen = trainer_cast(module), {"bridge": samples(engine)}
    out["replay"] = replay(engine, sync.kept, log)
    out["replay_final"] = drift(engine, cast)
    seen["vllm_patches"] = out["replay"].pop("vllm_greedy")
    seen["bridge_after_replay"] = samples(engine)
    log("  cold start on the trainer's final cast")
    out["cold_start"] = against_cold(seen, model, cast, root / "cold")
    del sync, module, cast, tensors
    shutil.rmtree(root / f"kept-{lr:g}", ignore_errors=True)
    log(f"  lr {lr:g}: complete run ({steps} steps)")
    out["complete"] = _fit(model, root, steps, lr, engine, delta=False)[2]
    return summarise_run(out)

def delta_size(size: str, workdir: str, steps: int, lrs: list[float], shm: str) -> dict:
    log, root = logger("delta"), Path(shm) / f"delta-{size}"
    model = harness.model_dir(Path(workdir) / f"delta_{size}", size)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    kwargs = {**harness.ENGINE_KWARGS, "dtype": ENGINE_DTYPE}
    out: dict[str, Any] = {"size": size, "model_dir": str(model), "runs": {},
                           "engine_kwargs": kwargs}
    log(f"{size}: engine ({kwargs})")
    engine = start_engine(model, root=root, dtype=ENGINE_DTYPE)
    try:
        for lr in lrs:
            out["runs"][f"{lr:g}"] = _run_lr(model, root, steps, lr, engine, log)
    finally:
        engine.close()
        shutil.rmtree(root, ignore_errors=True)
    out["startup_s"] = engine.startup_s
    return out

def section(args: Any, workdir: Path) -> dict[str, Any]:
    sizes = harness.per_size("benchmarks.delta:delta_size", args.delta_sizes, workdir,
                             logger("delta"), steps=args.delta_steps, lrs=args.delta_lrs,
                             shm=args.shm_dir)
    return {"what": (__doc__ or "").replace("\n", " "), "engine_dtype": ENGINE_DTYPE,
            "steps": args.delta_steps, "lrs": args.delta_lrs, "sizes": sizes}

def summarise_run(run: dict[str, Any]) -> dict[str, Any]:
    """One (size, lr) run's summary, ratios, checks and targets."""
    deltas = [r for r in run["delta"] if r["delta"]]
    rows = run["replay"]["deltas"]
    vllm, bridge = [r["vllm"] for r in rows], [r["bridge"] for r in rows]
    s: dict[str, Any] = {}
    complete = [r for r in run["complete"] if r["step"] >= 2]  # as the deltas: from step 2 on
    for kind, records in (("delta", deltas), ("complete", complete)):
        s[kind] = {k: stats(r[k] for r in records if r.get(k) is not None) for k in KEYS}
        s[kind].update(file_bytes=stats(r["file_bytes"] for r in records),
                       changed=stats(r["changed"] for r in records if r.get("changed") is not None),
                       save_apply_s=stats(r["save_s"] + r["apply_s"] for r in records),
                       syncs=len(records))
    s["replay"] = {
        "vllm_apply_s": stats(v["apply_wall_s"] for v in vllm),
        "vllm_apply_in_worker_s": stats(v["apply_s"] + v["decode_s"] for v in vllm),
        "vllm_repack_s": stats(v["refresh_s"] for v in vllm),
        "bridge_apply_s": stats(b["apply_s"] for b in bridge),
        "bridge_repack_s": stats(b["repack_s"] for b in bridge),
        "paired_x": stats(v["apply_wall_s"] / b["apply_s"]
                          for v, b in zip(vllm, bridge, strict=True)),
        "same_bits": all(r["same_bits"] for r in rows),
        "vllm_equals_trainer": all(v["equals_trainer"] for v in vllm),
        "vllm_restored": all(v["restored"] for v in vllm)}
    run["summary"], full = s, s["complete"]["file_bytes"]["median"]
    d, c, r = (s[k] for k in ("delta", "complete", "replay"))
    run["ratios"] = {
        "bytes_largest": ratio(max((x["file_bytes"] for x in deltas), default=None), full),
        "bytes_median": ratio(d["file_bytes"]["median"], full),
        "save_apply": ratio(d["save_apply_s"]["median"], c["save_apply_s"]["median"]),
        "vllm_patches": ratio(r["vllm_apply_s"]["median"], r["bridge_apply_s"]["median"]),
        "diff_floor": ratio(stats(run.get("diff_floor_s", []))["median"],
                            c["save_apply_s"]["median"]),
        "push_with_repack": ratio(d["push_s"]["median"], c["push_s"]["median"])}
    drifted, cold = [x["step"] for x in run["drift"] if not x["equal"]], run["cold_start"]
    bridge_cold = cold["bridge"]["match"] and cold["bridge_after_replay"]["match"]
    run["checks"] = {"syncs_checked": len(run["drift"]), "syncs_drifted": drifted,
                     "replay_equals_trainer": run["replay_final"]["equal"],
                     "cold_start_equals_bridge": bridge_cold,
                     "cold_start_equals_vllm_patches": cold["vllm_patches"]["match"]}
    zero = bool(run["drift"]) and not drifted and run["replay_final"]["equal"] and bridge_cold
    measured = {"save_apply": run["ratios"]["save_apply"], "zero_drift": zero,
                "vllm_patches": run["ratios"]["vllm_patches"],
                "bytes": run["ratios"]["bytes_largest"]}
    run["targets"] = {name: verdict(measured[name], *TARGETS[name]) for name in
                      ("save_apply", "vllm_patches", "zero_drift", "bytes")
                      if name != "bytes" or run["lr"] == BYTES_LR}
    return run

def missed(section: dict[str, Any]) -> list[str]:
    return [f"{size} lr {lr}: {name}" for size, s in section.get("sizes", {}).items()
            for lr, run in s.get("runs", {}).items() for name, t in run["targets"].items()
            if t["met"] is not True]

def render(section: dict[str, Any]) -> str:
    syncs, replays, targets, floors, spreads = [], [], [], [], []
    for size, s in section.get("sizes", {}).items():
        if "error" in s:
            syncs.append([size, f"error: {s['error']}", *[""] * 9])
        for lr, run in s.get("runs", {}).items():
            r, c = run["summary"]["replay"], run["checks"]
            full = run["summary"]["complete"]["file_bytes"]["median"]
            for kind in ("delta", "complete"):
                k = run["summary"][kind]
                syncs.append([size, lr, f"{kind} ({k['syncs']})",
                              spread(k["changed"], 2, 100) if kind == "delta" else "100 (all)",
                              spread(k["file_bytes"], 1, 2**-20),
                              fmt(ratio(k["file_bytes"]["median"], full), ".3f"),
                              *(spread(k[x]) for x in ("save_s", "push_s", "apply_s", "repack_s",
                                                        "save_apply_s"))])
            replays.append([size, lr, spread(r["bridge_apply_s"]), spread(r["vllm_apply_s"]),
                            spread(r["vllm_apply_in_worker_s"]), fmt(run["ratios"]["vllm_patches"]),
                            f"{spread(r['bridge_repack_s'])} / {spread(r['vllm_repack_s'])}",
                            "yes" if r["same_bits"] else "**no**",
                            "yes" if r["vllm_equals_trainer"] else "**no**",
                            f"{c['cold_start_equals_bridge']} / "
                            f"{c['cold_start_equals_vllm_patches']}"])
            for name, t in run["targets"].items():
                value, limit = harness.measured_and_limit(t)
                shown = f"{value:.3f}" if isinstance(value, float) else str(value)
                mark = {True: "✓", False: "✗", None: "n/a"}[t["met"]]
                targets.append([size, lr, name, t["what"], f"{shown} ({t['op']} {limit}) {mark}"])
            if run.get("diff_floor_s") and run["ratios"].get("diff_floor") is not None:
                floors.append(f"{size} lr {lr}: {stats(run['diff_floor_s'])['median']:.3f} s = "
                              f"{run['ratios']['diff_floor']:.2f}x")
            spreads.append(f"{size} lr {lr}: " + ", ".join(
                f"{k} {v:.3g}" for k, v in run["cold_start"]["spread"].items()))
    return "\n".join([
        "## Delta sync (bf16 engine, real Trainer, AdamW)", "",
        "Per run, median [min–max] over its syncs (deltas: every sync after the bf16 keyframe; "
        'complete: the same steps of the run with `delta="off"`). Apply = push − CPU re-pack.', "",
        *table(["size", "lr", "syncs", "changed %", "MiB per sync", "/ complete bf16", "save s",
                "push s", "apply s", "CPU re-pack s", "save + apply s"], syncs), "",
        "The same delta files replayed into the same engine: vLLM's own "
        "`load_checkpoint_weight_patches` then the bridge's push, on the same base each time.", "",
        *table(["size", "lr", "bridge apply s", "vLLM patches s (RPC in)",
                "vLLM patches s (in worker)", "vLLM / bridge", "re-pack s (bridge / after vLLM)",
                "same bits", "vLLM = trainer", "cold start = bridge / vLLM"], replays), "",
        *table(["size", "lr", "target", "what", "measured (target)"], targets),
        *(["", "The diff alone, with nothing changed (the trainer's weights cast and compared with "
           "a reference equal to that cast: what every delta save reads), against a complete "
           "bf16 sync's save + write, median of 3: " + "; ".join(floors) + "."] if floors else []),
        "", "Cold start: 4 greedy runs of the prompts on each engine; equal when every pair has "
        "the same tokens and some pair the same top-3 logprobs (within 1e-4). Largest logprob "
        "difference between two runs of one engine in one state (vLLM's own run-to-run "
        "variation in bf16): " + "; ".join(spreads) + ".",
        "", f"Load during the section: {section.get('load', {})}", ""])
# fmt: on
