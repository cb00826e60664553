"""Soak: many pushes into one live engine, alternating two checkpoints; no drift allowed.

    python tests/soak.py [--pushes 2000] [--check-every 100] [--sample-every 10] [--resave]
                         [--json soak.json]

Starts the tiny Llama in-process (the engine and its worker live in this process, so /proc/self
sees all of it), pushes checkpoints A and B alternately and every ``--check-every`` pushes
compares greedy outputs with those of cold-started engines on A and B (recorded once, each in a
process of its own). Every ``--sample-every`` pushes it records VmRSS, RssAnon, the number of
open file descriptors and threads, and the push time. ``--resave`` re-saves the checkpoint
with ``save_checkpoint`` to one path before each push and pushes it with ``verify_hash=True``,
as a trainer would. The summary compares the start (after a warm-up) with the end: memory and
descriptors must be flat. ``run_soak`` is what the slow test in ``test_reliability.py`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from weight_bridge.testing.parity import greedy, parity_problems
from weight_bridge.testing.procfs import proc_status_fields


def proc_status() -> dict[str, int]:
    """VmRSS and RssAnon (kB) of this process, open descriptors, OS and Python threads."""
    out = {"fds": len(os.listdir("/proc/self/fd")), "py_threads": threading.active_count()}
    return out | proc_status_fields("self", ("VmRSS", "RssAnon", "Threads"))


def _slope_per_1000(xs: list[float], ys: list[float]) -> float:
    if len(xs) < 2 or len(set(xs)) < 2:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    num = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    den = sum((x - mx) ** 2 for x in xs)
    return 1000.0 * num / den


def run_soak(
    engine,
    checkpoints: Mapping[str, Path],
    cold: Mapping[str, list],
    pushes: int = 2000,
    check_every: int = 100,
    sample_every: int = 10,
    resave_dir: Path | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Push ``checkpoints`` (two, alternating) ``pushes`` times; check parity; sample resources.

    ``cold`` maps each checkpoint's label to the greedy outputs of a cold start on it. Returns
    the samples, the parity failures and a summary of drift after the warm-up.
    """
    labels = list(checkpoints)
    tensors = {}
    if resave_dir is not None:
        from weight_bridge.checkpoint import CheckpointReader

        for label, path in checkpoints.items():
            with CheckpointReader(path) as reader:
                tensors[label] = {n: t.clone() for n, t in reader.tensors()}
    samples: list[dict] = []
    failures: list[dict] = []
    push_ms: list[float] = []
    # Warm-up, not counted: one push and one generate, so that the allocations of the first
    # generate call (vLLM's sampler, a tokenizer thread) do not read as drift.
    engine.push(checkpoints[labels[0]], version=(0, labels[0]))
    checks = 1
    if parity_problems(greedy(engine), cold[labels[0]]):
        failures.append({"push": 0, "label": labels[0]})
    started = time.perf_counter()
    for i in range(1, pushes + 1):
        label = labels[i % len(labels)]
        t0 = time.perf_counter()
        if resave_dir is not None:
            from weight_bridge.checkpoint import save_checkpoint

            target = save_checkpoint(tensors[label], resave_dir / "policy.safetensors").path
            engine.push(target, version=(i, label), verify_hash=True)
        else:
            engine.push(checkpoints[label], version=(i, label))
        push_ms.append(1000 * (time.perf_counter() - t0))
        if i % check_every == 0 or i == pushes:
            checks += 1
            got = greedy(engine)
            if parity_problems(got, cold[label]):
                failures.append({"push": i, "label": label})
                log(f"push {i}: PARITY FAILURE against cold {label}")
        if i % sample_every == 0 or i == 1:
            s = proc_status() | {"push": i, "push_ms": round(push_ms[-1], 2)}
            samples.append(s)
        if i % max(1, pushes // 20) == 0:
            s = samples[-1]
            log(
                f"push {i:5d}/{pushes}  VmRSS {s['VmRSS'] / 1024:7.1f} MiB  RssAnon "
                f"{s['RssAnon'] / 1024:7.1f} MiB  fds {s['fds']:4d}  threads {s['Threads']:3d}  "
                f"push {statistics.median(push_ms[-50:]):6.1f} ms (median of last 50)"
            )
    elapsed = time.perf_counter() - started
    return {
        "pushes": pushes,
        "elapsed_s": round(elapsed, 1),
        "parity_checks": checks,
        "parity_failures": failures,
        "samples": samples,
        "summary": summarize(samples, push_ms),
    }


def summarize(samples: list[dict], push_ms: list[float]) -> dict:
    """Start (first sample after a 10% warm-up) vs end (median of the last 10%) and slopes."""
    n = len(samples)
    warm = samples[max(1, n // 10) :] or samples
    tail = warm[-max(1, len(warm) // 10) :]
    head = warm[: max(1, len(warm) // 10)]
    out: dict = {"samples": n}
    for key in ("VmRSS", "RssAnon", "fds", "Threads"):
        start = statistics.median(s[key] for s in head)
        end = statistics.median(s[key] for s in tail)
        out[key] = {
            "start": start,
            "end": end,
            "drift": end - start,
            "min": min(s[key] for s in warm),
            "max": max(s[key] for s in warm),
            "slope_per_1000_pushes": round(
                _slope_per_1000([s["push"] for s in warm], [s[key] for s in warm]), 2
            ),
        }
    quarter = max(1, len(push_ms) // 4)
    out["push_ms"] = {
        "median_first_quarter": round(statistics.median(push_ms[:quarter]), 2),
        "median_last_quarter": round(statistics.median(push_ms[-quarter:]), 2),
        "p99": round(sorted(push_ms)[int(0.99 * (len(push_ms) - 1))], 2),
        "max": round(max(push_ms), 2),
    }
    return out


def format_summary(result: dict) -> str:
    s = result["summary"]
    lines = [
        f"soak: {result['pushes']} pushes in {result['elapsed_s']} s, "
        f"{result['parity_checks']} cold-start parity checks, "
        f"{len(result['parity_failures'])} failures",
        f"{'':10s} {'start':>12s} {'end':>12s} {'drift':>10s} {'min':>12s} {'max':>12s} "
        f"{'slope/1000':>11s}",
    ]
    for key, unit, scale in (
        ("VmRSS", "MiB", 1024),
        ("RssAnon", "MiB", 1024),
        ("fds", "", 1),
        ("Threads", "", 1),
    ):
        v = s[key]
        lines.append(
            f"{key + (' ' + unit if unit else ''):10s} {v['start'] / scale:12.1f} "
            f"{v['end'] / scale:12.1f} {v['drift'] / scale:+10.2f} {v['min'] / scale:12.1f} "
            f"{v['max'] / scale:12.1f} {v['slope_per_1000_pushes'] / scale:+11.2f}"
        )
    p = s["push_ms"]
    lines.append(
        f"push ms: median first quarter {p['median_first_quarter']}, last quarter "
        f"{p['median_last_quarter']}, p99 {p['p99']}, max {p['max']}"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pushes", type=int, default=2000)
    parser.add_argument("--check-every", type=int, default=100)
    parser.add_argument("--sample-every", type=int, default=10)
    parser.add_argument("--resave", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from helpers import ENGINE_KWARGS, assert_differs, run_engine_check

    from weight_bridge import ColocatedEngine
    from weight_bridge.testing.models import build_tiny_model, perturb_checkpoint

    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        root = Path(tmp)
        a = build_tiny_model(root / "llama_A", arch="llama", seed=0)
        b = perturb_checkpoint(a, root / "llama_B", scale=0.3, seed=1)
        print("recording cold-start outputs of A and B (a process of their own)...", flush=True)
        colds = run_engine_check("cold", str(a), str(b), multiprocess=False)["colds"]
        cold = {"A": colds[0], "B": colds[1]}
        assert_differs(cold["A"], cold["B"])
        with ColocatedEngine(a, **ENGINE_KWARGS) as engine:
            result = run_soak(
                engine,
                {"A": a, "B": b},
                cold,
                pushes=args.pushes,
                check_every=args.check_every,
                sample_every=args.sample_every,
                resave_dir=root if args.resave else None,
                log=lambda line: print(line, flush=True),
            )
    print(format_summary(result), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    sys.exit(1 if result["parity_failures"] else 0)


if __name__ == "__main__":
    main()
