"""The "delta sync" section's summary, targets and markdown tables (:mod:`benchmarks.delta`)."""

from __future__ import annotations

from typing import Any

from .stats import ratio, stats

__all__ = ["DELTA_TARGETS", "missed", "render_delta", "summarise_run"]

BYTES_LR = 1e-6  # the learning rate the bytes target is set at
DELTA_TARGETS: dict[str, dict[str, Any]] = {
    "bytes": {
        "op": "<=",
        "value": 0.10,
        "what": "largest delta file / median complete bf16 file, at lr 1e-6",
    },
    "save_apply": {
        "op": "<=",
        "value": 0.25,
        "what": "delta sync's save + apply (push minus CPU re-pack) / complete bf16 sync's "
        "save + write (push minus CPU re-pack), medians over the syncs",
    },
    "vllm_patches": {
        "op": ">=",
        "value": 3.0,
        "what": "vLLM's load_checkpoint_weight_patches (in the worker, RPC included, re-pack "
        "excluded) / the bridge's apply (push minus re-pack), same delta, same engine, medians",
    },
    "zero_drift": {
        "op": "==",
        "value": True,
        "what": "after every sync the engine's exact fingerprints equal the trainer's bf16 "
        "cast, and after the last delta a stock cold start on that cast equals the engine "
        "(greedy tokens; top-3 logprobs of one of 4 runs each, as vLLM's bf16 runs vary)",
    },
}
KEYS = ("save_s", "push_s", "apply_s", "repack_s", "preflight_s", "write_s", "readback_s")


def _summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    out = {k: stats(r[k] for r in records if r.get(k) is not None) for k in KEYS}
    out["file_bytes"] = stats(r["file_bytes"] for r in records)
    out["changed"] = stats(r["changed"] for r in records if r.get("changed") is not None)
    out["save_apply_s"] = stats(r["save_s"] + r["apply_s"] for r in records)
    out["syncs"] = len(records)
    return out


def _replay_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    vllm = [r["vllm"] for r in rows]
    bridge = [r["bridge"] for r in rows]
    return {
        "vllm_apply_s": stats(v["apply_wall_s"] for v in vllm),
        "vllm_apply_in_worker_s": stats(v["apply_s"] + v["decode_s"] for v in vllm),
        "vllm_repack_s": stats(v["refresh_s"] for v in vllm),
        "bridge_apply_s": stats(b["apply_s"] for b in bridge),
        "bridge_repack_s": stats(b["repack_s"] for b in bridge),
        "paired_x": stats(
            v["apply_wall_s"] / b["apply_s"] for v, b in zip(vllm, bridge, strict=True)
        ),
        "same_bits": all(r["same_bits"] for r in rows),
        "vllm_equals_trainer": all(v["equals_trainer"] for v in vllm),
        "vllm_restored": all(v["restored"] for v in vllm),
    }


def _target(name: str, measured: Any) -> dict[str, Any]:
    t = DELTA_TARGETS[name]
    if measured is None:
        met = None
    elif t["op"] == "<=":
        met = measured <= t["value"]
    elif t["op"] == ">=":
        met = measured >= t["value"]
    else:
        met = measured == t["value"]
    return {**t, "measured": measured, "met": met}


def summarise_run(run: dict[str, Any]) -> dict[str, Any]:
    """Add ``summary``, ``ratios`` and ``targets`` to one (size, lr) run."""
    deltas = [r for r in run["delta"] if r["delta"]]
    complete = [r for r in run["complete"] if r["step"] >= 2]  # as the deltas: from step 2 on
    s = {"delta": _summary(deltas), "complete": _summary(complete)}
    s["replay"] = _replay_summary(run["replay"]["deltas"])
    run["summary"] = s
    full = s["complete"]["file_bytes"]["median"]
    largest = max((r["file_bytes"] for r in deltas), default=None)
    drifted = [c["step"] for c in run["drift"] if not c["equal"]]
    cold = run["cold_start"]
    bridge_cold = cold["bridge"]["match"] and cold["bridge_after_replay"]["match"]
    run["ratios"] = {
        "bytes_largest": ratio(largest, full),
        "bytes_median": ratio(s["delta"]["file_bytes"]["median"], full),
        "save_apply": ratio(
            s["delta"]["save_apply_s"]["median"], s["complete"]["save_apply_s"]["median"]
        ),
        "vllm_patches": ratio(
            s["replay"]["vllm_apply_s"]["median"], s["replay"]["bridge_apply_s"]["median"]
        ),
        "diff_floor": ratio(
            stats(run.get("diff_floor_s", []))["median"], s["complete"]["save_apply_s"]["median"]
        ),
        "push_with_repack": ratio(
            s["delta"]["push_s"]["median"], s["complete"]["push_s"]["median"]
        ),
    }
    run["checks"] = {
        "syncs_checked": len(run["drift"]),
        "syncs_drifted": drifted,
        "replay_equals_trainer": run["replay_final"]["equal"],
        "cold_start_equals_bridge": bridge_cold,
        "cold_start_equals_vllm_patches": cold["vllm_patches"]["match"],
    }
    zero = bool(run["drift"]) and not drifted and run["replay_final"]["equal"] and bridge_cold
    run["targets"] = {
        "save_apply": _target("save_apply", run["ratios"]["save_apply"]),
        "vllm_patches": _target("vllm_patches", run["ratios"]["vllm_patches"]),
        "zero_drift": _target("zero_drift", zero),
    }
    if run["lr"] == BYTES_LR:
        run["targets"]["bytes"] = _target("bytes", run["ratios"]["bytes_largest"])
    return run


def missed(section: dict[str, Any]) -> list[str]:
    """``size lr: target`` for every target missed (or not measured)."""
    return [
        f"{size} lr {lr}: {name}"
        for size, s in section.get("sizes", {}).items()
        for lr, run in s.get("runs", {}).items()
        for name, t in run["targets"].items()
        if t["met"] is not True
    ]


def _m(d: dict[str, Any], scale: float = 1.0, digits: int = 3) -> str:
    if not d or d.get("median") is None:
        return "n/a"
    lo, mid, hi = (scale * d[k] for k in ("min", "median", "max"))
    return f"{mid:.{digits}f} [{lo:.{digits}f}–{hi:.{digits}f}]"


def _x(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}×"


def _syncs(size: str, lr: str, run: dict[str, Any]) -> list[str]:
    lines = []
    full = run["summary"]["complete"]["file_bytes"]["median"]
    for kind in ("delta", "complete"):
        s = run["summary"][kind]
        changed = _m(s["changed"], 100, 2) if kind == "delta" else "100 (all)"
        share = ratio(s["file_bytes"]["median"], full)
        lines.append(
            f"| {size} | {lr} | {kind} ({s['syncs']}) | {changed} "
            f"| {_m(s['file_bytes'], 2**-20, 1)} | {_x(share, 3)} | {_m(s['save_s'])} "
            f"| {_m(s['push_s'])} | {_m(s['apply_s'])} | {_m(s['repack_s'])} "
            f"| {_m(s['save_apply_s'])} |"
        )
    return lines


def _replay(size: str, lr: str, run: dict[str, Any]) -> str:
    r, c = run["summary"]["replay"], run["checks"]
    same = "yes" if r["same_bits"] else "**no**"
    right = "yes" if r["vllm_equals_trainer"] else "**no**"
    cold = f"{c['cold_start_equals_bridge']} / {c['cold_start_equals_vllm_patches']}"
    return (
        f"| {size} | {lr} | {_m(r['bridge_apply_s'])} | {_m(r['vllm_apply_s'])} "
        f"| {_m(r['vllm_apply_in_worker_s'])} | {_x(run['ratios']['vllm_patches'])} "
        f"| {_m(r['bridge_repack_s'])} / {_m(r['vllm_repack_s'])} | {same} | {right} | {cold} |"
    )


def _verdict(t: dict[str, Any]) -> str:
    m = t["measured"]
    shown = f"{m:.3f}" if isinstance(m, float) else str(m)
    return f"{shown} ({t['op']} {t['value']}) " + {True: "✓", False: "✗", None: "n/a"}[t["met"]]


SYNCS_HEAD = [
    "## Delta sync (bf16 engine, real Trainer, AdamW)",
    "",
    "Per run, median [min–max] over its syncs (deltas: every sync after the bf16 keyframe; "
    'complete: the same steps of the run with `delta="off"`). Apply = push − CPU re-pack.',
    "",
    "| size | lr | syncs | changed % | MiB per sync | / complete bf16 | save s | push s "
    "| apply s | CPU re-pack s | save + apply s |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
]
REPLAY_HEAD = [
    "",
    "The same delta files replayed into the same engine: vLLM's own "
    "`load_checkpoint_weight_patches` then the bridge's push, on the same base each time.",
    "",
    "| size | lr | bridge apply s | vLLM patches s (RPC in) | vLLM patches s (in worker) "
    "| vLLM / bridge | re-pack s (bridge / after vLLM) | same bits | vLLM = trainer "
    "| cold start = bridge / vLLM |",
    "|---|---|---|---|---|---|---|---|---|---|",
]
TARGETS_HEAD = ["", "| size | lr | target | what | measured (target) |", "|---|---|---|---|---|"]


def _spread(runs: list[tuple[str, str, dict[str, Any]]]) -> list[str]:
    cells = [
        f"{size} lr {lr}: "
        + ", ".join(f"{k} {v:.3g}" for k, v in run["cold_start"]["spread"].items())
        for size, lr, run in runs
    ]
    return [
        "",
        "Cold start: 4 greedy runs of the prompts on each engine; equal when every pair has the "
        "same tokens and some pair the same top-3 logprobs (within 1e-4). Largest logprob "
        "difference between two runs of one engine in one state (vLLM's own run-to-run "
        "variation in bf16): " + "; ".join(cells) + ".",
    ]


def _floor(runs: list[tuple[str, str, dict[str, Any]]]) -> list[str]:
    cells = [
        f"{size} lr {lr}: {stats(run['diff_floor_s'])['median']:.3f} s = "
        f"{run['ratios']['diff_floor']:.2f}x"
        for size, lr, run in runs
        if run.get("diff_floor_s") and run["ratios"].get("diff_floor") is not None
    ]
    if not cells:
        return []
    return [
        "",
        "The diff alone, with nothing changed (the trainer's weights cast and compared with a "
        "reference equal to that cast: what every delta save reads), against a complete bf16 "
        "sync's save + write, median of 3: " + "; ".join(cells) + ".",
    ]


def render_delta(section: dict[str, Any]) -> str:
    """The section as markdown tables."""
    syncs, replay, targets = list(SYNCS_HEAD), list(REPLAY_HEAD), list(TARGETS_HEAD)
    runs = []
    for size, s in section.get("sizes", {}).items():
        if "error" in s:
            syncs.append(f"| {size} | error: {s['error']} | | | | | | | | | |")
            continue
        for lr, run in s["runs"].items():
            runs.append((size, lr, run))
            syncs += _syncs(size, lr, run)
            replay.append(_replay(size, lr, run))
            for name, t in run["targets"].items():
                targets.append(f"| {size} | {lr} | {name} | {t['what']} | {_verdict(t)} |")
    load = ["", f"Load during the section: {section.get('load', {})}", ""]
    return "\n".join(syncs + replay + targets + _floor(runs) + _spread(runs) + load)
