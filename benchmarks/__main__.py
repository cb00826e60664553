"""The one command of the benchmark harness (docs/benchmarks.md):

    python -m benchmarks --out bench/results.json        # make bench: every ``full`` section
    python -m benchmarks --quick --out /tmp/r.json       # smoke run: 1m, 2 reps, the push paths
    python -m benchmarks --only ranks --out bench/results-ranks.json   # one section of REGISTRY
    python -m benchmarks --render bench/results.json     # redraw a JSON's .md

Targets are reported, never asserted: the exit code is 1 when a correctness check failed or a
measurement raised (``--strict``: 2 when a target was missed). ``--only NAME`` merges its section
into ``--out`` under its key, or writes it as its own file (ranks, clients)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from . import delta, harness, inflight, ranks, sync, vllm034
from .engines import GEN_BATCH
from .push import bench_size
from .push_report import ENGINES, TARGETS, analyse, render_markdown


# fmt: off
@dataclass(frozen=True)
class Section:
    """A section: ``run(args, workdir)``, ``render(result)``; ``full(args)``: in the full run;
    ``appended``: after the push report; ``own_file``: a results file of its own; ``failed``."""
    run: Callable[[argparse.Namespace, Path], dict[str, Any]]
    render: Callable[[dict[str, Any]], str]
    full: Callable[[argparse.Namespace], Any] | None = None
    appended: bool = True
    own_file: bool = False
    failed: Callable[[dict[str, Any]], bool] = lambda result: False

REGISTRY = {
    "fsdp": Section(sync.section_fsdp, sync.render_fsdp, lambda a: a.fsdp_size, False),
    "inflight": Section(inflight.section, inflight.render, lambda a: a.inflight_size, False),
    "sync": Section(sync.section_sync, sync.render_sync, lambda a: a.sync_sizes),
    "vllm034": Section(vllm034.section, vllm034.render),
    "delta": Section(delta.section, delta.render, lambda a: a.delta_sizes),
    "default": Section(sync.section_default, sync.render_default, lambda a: a.default_sizes),
    "ranks": Section(ranks.section, ranks.render, None, False, True, ranks.failed),
    "clients": Section(inflight.section_clients, inflight.render_clients, None, False, True,
                       inflight.clients_failed)}
OPTIONS = [  # flag, default (its type the option's), help
    ("--sizes", "100m,smollm2", "push section sizes ('smollm2': the real SmolLM2-135M)"),
    ("--reps", 5, "repetitions of every measurement"), ("--gen-tokens", 16, "generation tokens"),
    ("--gen-sizes", "100m,smollm2", "sizes whose generation speed is measured"),
    ("--gen-reps", 3, "generation reps"), ("--fsdp-reps", 4, "syncs per FSDP/DDP job"),
    ("--http-sizes", None, "sizes pushed through vllm serve too (default: all)"),
    ("--fsdp-size", "100m", "FSDP2 vs DDP sync size ('none': skip)"),
    ("--inflight-size", "10m", "in-flight pushes' size ('none': skip)"),
    ("--inflight-pushes", 8, "pushes per in-flight mode"),
    ("--recipe-steps", 40, "GRPO recipe steps, sync and async (0: skip)"),
    ("--sync-sizes", "100m,smollm2", "sizes of 'sync end to end' ('none': skip)"),
    ("--sync-reps", 9, "syncs timed per variant of 'sync' and 'default'"),
    ("--delta-sizes", "100m,smollm2", "sizes of 'delta sync' ('none': skip)"),
    ("--delta-lrs", "1e-06,1e-05", "AdamW learning rates of 'delta sync'"),
    ("--delta-steps", 7, "optimizer steps per run of 'delta sync'"),
    ("--default-sizes", "100m", "sizes of 'default sync' ('none': skip)"),
    ("--size", None, "the size of --only ranks (default 100m) or clients (10m)"),
    ("--rate", 4.0, "clients: requests a second"), ("--seconds", 30.0, "clients: s a phase"),
    ("--every", 3.0, "clients: seconds between pushes"), ("--max-tokens", 16, "clients: tokens"),
    ("--workdir", None, "models and disk saves (default: a temporary directory)"),
    ("--shm-dir", "/dev/shm", "tmpfs for the saves"), ("--out", None, "JSON results (default: "
     "bench/results.json, or bench/results-NAME.json for a section with a file of its own)"),
    ("--render", None, "only redraw the .md of a results JSON")]
FLAGS = [("--quick", "smoke run: 1m, 2 reps, no generation/HTTP/FSDP/trainer sections"),
         ("--keep", "keep the built models"), ("--strict", "exit 2 when a target is missed")]

def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")

def write_markdown(results: dict[str, Any], out: Path, only: str | None = None) -> Path:
    """``out``'s ``.md``: a section's own file, the full report, or the sections it holds."""
    md = out.with_suffix(".md")
    if only is not None and REGISTRY[only].own_file:
        md.write_text(REGISTRY[only].render(results))
    elif "schema" not in results:
        md.write_text("\n".join(s.render(results[n]) for n, s in REGISTRY.items() if n in results))
    else:
        extra = [s.render(results[n]) for n, s in REGISTRY.items() if s.appended and results.get(n)]
        md.write_text(render_markdown(results) + "".join("\n" + text for text in extra))
    return md

def run_only(args: argparse.Namespace, command: str) -> int:
    sec, started, load = REGISTRY[args.only], _now(), harness.CpuLoad()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="wb-bench-"))
    with harness.scratch(workdir / args.only) as d:
        result = sec.run(args, d)
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    result.update(load=load.report(), started=started, finished=_now(), command=command,
                  section=args.only)
    merged = result
    if not sec.own_file:
        merged = json.loads(args.out.read_text()) if args.out.exists() else {}
        merged[args.only] = result
    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(merged, indent=2 if sec.own_file else 1, default=str)
    args.out.write_text(text + "\n" * sec.own_file)
    print(sec.render(result), args.out, write_markdown(merged, args.out, args.only), sep="\n")
    return 1 if sec.failed(result) else 0

def run_all(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Every size of the push section, then the full run's sections; the verdict, the errors."""
    t0, load, log = time.perf_counter(), harness.CpuLoad(), harness.logger
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="wb-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    keys = ("sizes", "reps", "gen_sizes", "gen_tokens", "gen_reps", "http_sizes", "fsdp_size",
            "fsdp_reps", "sync_reps", "delta_sizes", "delta_lrs", "delta_steps", "default_sizes",
            "inflight_size", "inflight_pushes", "recipe_steps", "quick")
    env = ("VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE", "OMP_NUM_THREADS")
    settings = {**{k: getattr(args, k) for k in keys}, "gen_batch": GEN_BATCH,
                "engine_kwargs": harness.ENGINE_KWARGS, "arch": harness.ARCH,
                "workdir": str(workdir), "workdir_fs": harness.fs_type(workdir),
                "env": {k: os.environ.get(k) for k in env}}
    results = {"schema": 2, "command": command, "make_target": "make bench  (= .venv/bin/python "
               "-m benchmarks --out bench/results.json)", "started": _now(),
               "machine": harness.machine_info(), "versions": harness.versions(),
               "settings": settings, "targets": TARGETS, "sizes": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        for size in args.sizes:
            results["sizes"][size] = analyse(bench_size(size, args, workdir))
            results["elapsed_s"], results["load"] = time.perf_counter() - t0, load.report()
            args.out.write_text(json.dumps(results, indent=1, default=str))  # partial results
        for name, sec in ((n, s) for n, s in REGISTRY.items() if s.full and s.full(args)):
            with harness.scratch(workdir / name) as d:
                results[name] = harness.section(name, lambda s=sec, d=d: s.run(args, d), log(name))
    finally:
        if args.workdir is None and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    machine, sizes = results["machine"], results["sizes"]
    machine.update({f"copy_bandwidth_{e}_bytes_per_s": harness.dig(  # the largest size's
        sizes[args.sizes[-1]], e, "copy", "rate_bytes_per_s") for e in ENGINES})
    machine["copy_bandwidth_bytes_per_s"] = (machine["copy_bandwidth_multiprocess_bytes_per_s"]
                                             or machine["copy_bandwidth_inprocess_bytes_per_s"])
    machine["copy_bandwidth_note"] = (
        "payload bytes per second of the copy_ limit (every tensor of the largest size, between "
        "preallocated tensors) inside the engine's worker process; memory traffic is about twice "
        "that (read + write)")
    results["correctness_passed"] = all(s["correctness"]["passed"] for s in sizes.values())
    results["errors"] = [f"{n}: {e}" for n, s in sizes.items() for e in s["errors"]]
    results["errors"] += [f"{n}: {results[n]['error'][-2000:]}" for n in ("fsdp", "inflight")
                          if "error" in (results.get(n) or {})]
    results["targets_missed"] = [f"{n}: {k}" for n, s in sizes.items()
                                 for k, t in s["targets"].items() if t["met"] is False]
    if isinstance(d := results.get("delta"), dict):
        results["errors"] += [f"delta {n}: {s['error']}" for n, s in d["sizes"].items()
                              if "error" in s]
        results["targets_missed"] += [f"delta {m}" for m in delta.missed(d)]
    results["elapsed_s"], results["load"] = time.perf_counter() - t0, load.report()
    return results

def parse_args(argv: list[str]) -> argparse.Namespace:
    from weight_bridge.testing.models import SIZES
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    for flag, default, help in OPTIONS:
        kind = Path if flag in ("--workdir", "--shm-dir", "--out", "--render") else type(default)
        p.add_argument(flag, type=str if kind is type(None) else kind, default=default, help=help)
    for flag, help in FLAGS:
        p.add_argument(flag, action="store_true", help=help)
    p.add_argument("--only", choices=list(REGISTRY), default=None, help="run this section alone")
    p.add_argument("--_child", dest="child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:  # the push paths on both engines and the in-flight pauses, nothing else
        args.sizes, args.gen_sizes, args.http_sizes, args.fsdp_size = "1m", "", "", ""
        args.reps, args.recipe_steps = min(args.reps, 2), 0  # the recipes' tests run them
        if args.inflight_size not in ("", "none"):
            args.inflight_size, args.inflight_pushes = "1m", min(args.inflight_pushes, 2)
        args.sync_sizes = args.delta_sizes = args.default_sizes = ""
    if args.http_sizes is None:
        args.http_sizes = args.sizes
    for key in ("sizes", "gen_sizes", "http_sizes", "sync_sizes", "delta_sizes",
                "default_sizes", "delta_lrs"):
        names = [s.strip() for s in getattr(args, key).split(",")]
        setattr(args, key, [s for s in names if s not in ("", "none")])
    args.delta_lrs = [float(x) for x in args.delta_lrs]
    args.fsdp_size = None if args.fsdp_size in ("", "none") else args.fsdp_size
    args.inflight_size = None if args.inflight_size in ("", "none") else args.inflight_size
    own = args.only is not None and REGISTRY[args.only].own_file
    args.out = args.out or Path(f"bench/results-{args.only}.json" if own else "bench/results.json")
    known = [*SIZES, harness.REAL_MODEL]
    if unknown := [s for s in [*args.sizes, args.fsdp_size] if s and s not in known]:
        p.error(f"unknown sizes {unknown}; choose from {known}")
    if args.fsdp_size == harness.REAL_MODEL or args.reps < 1:
        p.error("--fsdp-size: a size the section builds (not the real model); --reps: at least 1")
    return args

def main(argv: list[str] | None = None) -> int:
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw_argv)
    command = shlex.join([sys.executable, "-m", "benchmarks", *raw_argv])
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    for key, value in (("HF_HUB_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"),
                       ("VLLM_TARGET_DEVICE", "cpu")):
        os.environ.setdefault(key, value)
    if args.child is not None:
        harness.run_child(Path(args.child))
        return 0
    if args.render is not None:  # a section's own file: by --only, its stamp or its file's name
        own = [n for n, s in REGISTRY.items() if s.own_file and args.render.stem == f"results-{n}"]
        results = json.loads(args.render.read_text())
        only = args.only or results.get("section") or next(iter(own), None)
        print(write_markdown(results, args.render, only))
        return 0
    if args.only is not None:
        return run_only(args, command)
    os.environ[harness.MULTIPROCESSING] = "0"  # in-process engines here, multi-process in children
    results = run_all(args, command)
    args.out.write_text(json.dumps(results, indent=1, default=str))
    md = write_markdown(results, args.out)
    print(md.read_text(), f"wrote {args.out}, {md} in {results['elapsed_s']:.0f} s", sep="\n")
    if not results["correctness_passed"] or results["errors"]:
        print("CORRECTNESS CHECK FAILED or a measurement raised; see the results", file=sys.stderr)
        return 1
    return 2 if args.strict and results["targets_missed"] else 0
# fmt: on


if __name__ == "__main__":
    sys.exit(main())
