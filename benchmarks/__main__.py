"""Benchmark: how fast a push is, against the limits of this machine and the alternatives.

    python -m benchmarks --out bench/results.json      # what ``make bench`` runs
    python -m benchmarks --quick --out /tmp/r.json     # smoke run: 1m, 2 reps, no generation,
                                                       # HTTP or FSDP sections
    python -m benchmarks --render bench/results.json   # redraw .md/.png from a JSON

For each model size (a Llama architecture, untied, fp32, built locally by
:mod:`weight_bridge.testing.models`, or ``smollm2``: the real SmolLM2-135M-Instruct, tied,
dequantized from its GGUF; model A is the engine's start, model B the "next policy"), on the
same engine and in the same run, every measurement is repeated ``--reps``
times, interleaved round-robin so that background load hits every method alike, and reported as
median with min/max and quartiles:

* limits, measured inside the engine's worker process (:class:`BenchWorkerExtension`), so in
  the same process, threads and memory binding as the push: ``copy`` (a plain ``copy_`` of the
  same tensors into preallocated tensors: the memory bandwidth) and ``read_copy`` (the
  safetensors file opened with :class:`~weight_bridge.checkpoint.CheckpointReader`, mmap views
  of the page cache, every tensor copied into preallocated memory);
* ours: :meth:`ColocatedEngine.push <weight_bridge.vllm.ColocatedEngine.push>` (vLLM's own
  RL update API with the ``weight_bridge`` backend; ``elapsed_s`` of the report, split into
  validation, write, read-back and refresh) with default guards, with ``check_finite`` off,
  with ``verify_hash`` and each read-back mode; in-process and, from a child process, the
  multi-process engine;
* each lever of the default CPU push on its own (:mod:`benchmarks.levers`: the allocator, the
  plan cache, the fixed cost of a push);
* vLLM's own checkpoint-format reload through its API (``collective_rpc("reload_weights",
  kwargs={"weights_path": ...})``) on the same engine and on vLLM's own engine without the
  bridge; its layerwise ``reload_weights`` from inside the worker, from the model directory and
  from an iterator over the same file; a naive per-tensor ``model.load_weights([(name, t)])``
  loop; a cold restart of the engine on the new checkpoint (in-process, ``enforce_eager=True``);
* the HTTP overhead of a push: the same push through a ``vllm serve`` process
  (:mod:`benchmarks.serve`, ``--http-sizes``);
* a sync from an FSDP2 trainer against one from a DDP trainer (:mod:`benchmarks.fsdp`,
  ``--fsdp-size``);
* save: :func:`~weight_bridge.checkpoint.save_checkpoint` against a raw write of the same bytes
  to the same directory, both fsynced, on disk and on ``/dev/shm``;
* peak extra resident memory during a push (``RssAnon`` and ``RssFile`` of ``/proc/PID/status``
  sampled in a background thread, plus the kernel's exact ``VmHWM`` after a reset);
* sync end to end (:mod:`benchmarks.sync`, ``--sync-sizes``, ``--sync-reps``; ``--only sync``
  runs it alone and merges it into ``--out``): the callback's save and push in a real Trainer, by
  default and with each lever on its own, against two memory copies of the model;
* delta sync (:mod:`benchmarks.delta`, ``--delta-sizes``, ``--delta-lrs``; ``--only delta``
  runs it alone): a real Trainer's deltas into a bf16 engine against complete bf16 syncs, and
  vLLM's own sparse patches applying the same deltas in the same engine;
* generation speed of the CPU linear modes (``cpu_linear`` repack / torch, repack with glibc's
  default allocator, and vLLM's own engine), multi-process engines alive together and
  measured round-robin (``--gen-sizes`` only).

Every path above runs on the in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, this
process) and on the multi-process engine (vLLM's default, in a child process started with
``--_child``: vLLM reads that variable once per process). Timed engine calls include their
RPCs; a reload by another path also pays the prefix-cache reset that a push pays.

Correctness is checked in every run: after the timed pushes, the pushed engine's greedy tokens
(and top-3 logprobs within 1e-4) on fixed token-id prompts must equal those of a cold start on
the same checkpoint. Targets are evaluated and reported, never asserted by tests; the exit code
is 1 only when a correctness check failed or a measurement raised (``--strict``: 2 when a target
was missed).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .analysis import analyse
from .config import (
    ARCH,
    DEFAULT_GEN_SIZES,
    DEFAULT_SIZES,
    ENGINE_KWARGS,
    ENGINES,
    FSDP_SIZE,
    GEN_BATCH,
    INFLIGHT_SIZE,
    QUICK_SIZES,
    REAL_MODEL,
    TARGETS,
)
from .delta import add_delta_arguments
from .machine import CpuLoad, fs_type, machine_info, versions
from .measure import bench_inprocess, bench_multiprocess, build_models, describe_checkpoint
from .plot import render_plot
from .report import dig, render_markdown
from .save import bench_save

__all__ = ["main"]


def _section(result: dict[str, Any], name: str, fn: Callable[[], dict], log: Any) -> None:
    """Run one section into ``result[name]``; an exception is recorded, not fatal."""
    log(f"{name} ...")
    load = CpuLoad()
    try:
        result[name] = fn()
    except Exception as exc:
        traceback.print_exc()
        result[name] = {"error": f"{type(exc).__name__}: {exc}"}
    result[name]["load"] = load.report()
    log(f"{name} done in {result[name]['load']['wall_s']:.1f} s")


def _errors(result: dict[str, Any], names: tuple[str, ...]) -> list[str]:
    """Every ``error`` entry up to three levels into the sections ``names``."""
    errors = []
    for name in names:
        sec = result.get(name, {})
        if "error" in sec:
            errors.append(f"{name}: {sec['error'][-2000:]}")
        for key, value in sec.items():
            if not isinstance(value, dict):
                continue
            if "error" in value:
                errors.append(f"{name}.{key}: {value['error']}")
            for sub, inner in value.items():
                if isinstance(inner, dict) and "error" in inner:
                    errors.append(f"{name}.{key}.{sub}: {inner['error']}")
    return errors


def bench_size(size: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    def log(msg: str) -> None:
        print(f"[bench {size}] {msg}", flush=True)

    load = CpuLoad()
    result: dict[str, Any] = {"size": size, "errors": []}
    log("building models A and B")
    t0 = time.perf_counter()
    a, b = build_models(workdir, size)
    result["build_s"] = time.perf_counter() - t0
    result["model"] = describe_checkpoint(b / "model.safetensors", size)
    gen = (args.gen_tokens, args.gen_reps) if size in args.gen_sizes else None
    http = size in args.http_sizes
    shm = args.shm_dir / f"wb-bench-{os.getpid()}"
    save_dirs = {"disk": workdir / "save", "shm": shm}
    sections: list[tuple[str, Callable[[], dict]]] = [
        ("inprocess", lambda: bench_inprocess(a, b, args.reps, log)),
        ("multiprocess", lambda: bench_multiprocess(a, b, args.reps, workdir, gen, http)),
        ("save", lambda: bench_save(b / "model.safetensors", save_dirs, args.reps)),
    ]
    for name, fn in sections:
        _section(result, name, fn, log)
    result["errors"] = _errors(result, ("inprocess", "multiprocess", "save"))
    shutil.rmtree(shm, ignore_errors=True)
    result["load"] = load.report()
    analyse(result)
    if not args.keep:
        for d in (a, b):
            shutil.rmtree(d, ignore_errors=True)
    return result


def bench_fsdp_section(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """:mod:`benchmarks.fsdp` (two Lightning jobs of two ranks each) as a section."""
    from .fsdp import bench_fsdp

    result: dict[str, Any] = {}
    fsdp_dir = workdir / "fsdp"
    fsdp_dir.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[bench fsdp] {msg}", flush=True)

    _section(result, "fsdp", lambda: bench_fsdp(fsdp_dir, args.fsdp_size, args.fsdp_reps, log), log)
    shutil.rmtree(fsdp_dir, ignore_errors=True)
    return result["fsdp"]


def bench_inflight_section(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """:mod:`benchmarks.inflight` in a process of its own (its ``AsyncLLM`` runs vLLM's
    multi-process engine, which this process has switched off)."""
    out = workdir / "inflight.json"
    cmd = [sys.executable, "-m", "benchmarks.inflight", "--size", args.inflight_size]
    cmd += ["--pushes", str(args.inflight_pushes), "--steps", str(args.recipe_steps)]
    cmd += ["--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    print(f"[bench inflight] {shlex.join(cmd)}", flush=True)
    done = subprocess.run(
        cmd, cwd=Path(__file__).resolve().parents[1], env=env, text=True, capture_output=True
    )
    if done.returncode != 0:
        return {"error": done.stderr[-4000:]}
    return json.loads(out.read_text())


def bench_sync_section(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """:mod:`benchmarks.sync`: the callback's sync in a real Trainer, default and each lever."""
    from .per_size import section_in
    from .sync import bench_sync

    return section_in(
        workdir,
        "sync",
        lambda d, log: bench_sync(d, args.sync_sizes, args.sync_reps, args.shm_dir, log),
    )


def _only_sections() -> dict[str, tuple[Callable, Callable[[dict], str]]]:
    """``--only`` sections: name -> (run(args, workdir), render(section))."""
    from .default_sync import default_section, render_default
    from .delta import delta_section
    from .delta_report import render_delta
    from .sync import render_sync
    from .vllm034 import bench_vllm034, render_vllm034

    def vllm034(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
        return bench_vllm034(
            workdir, args.reps, lambda m: print(f"[bench vllm034] {m}", flush=True)
        )

    return {
        "sync": (bench_sync_section, render_sync),
        "vllm034": (vllm034, render_vllm034),
        "delta": (delta_section, render_delta),
        "default": (default_section, render_default),
    }


def _run_only(args: argparse.Namespace) -> int:
    """``--only NAME``: the section alone, merged into ``--out`` (other keys kept)."""
    run, render = _only_sections()[args.only]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="wb-bench-"))
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    try:
        section = run(args, workdir)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    section["started"] = started
    section["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    section["command"] = shlex.join([sys.executable, "-m", "benchmarks", *sys.argv[1:]])
    merged = json.loads(args.out.read_text()) if args.out.exists() else {}
    merged[args.only] = section
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(merged, indent=1, default=str))
    print(render(section))
    print(f"merged the {args.only} section into {args.out}")
    if "schema" in merged:  # a full run's results: its .md (and plot) include the section now
        for p in write_outputs(merged, args.out):
            print(p)
    else:  # sections alone: their tables
        md = args.out.with_suffix(".md")
        md.write_text(
            "\n".join(r(merged[n]) for n, (_, r) in _only_sections().items() if n in merged)
        )
        print(md)
    return 0


def write_outputs(results: dict[str, Any], out: Path) -> tuple[Path, Path]:
    md, png = out.with_suffix(".md"), out.with_suffix(".png")
    extra = [r(results[n]) for n, (_, r) in _only_sections().items() if results.get(n)]
    md.write_text(render_markdown(results) + "".join("\n" + text for text in extra))
    try:
        render_plot(results, png)
    except Exception as exc:  # the numbers matter more than the picture
        print(f"plot failed: {exc}", file=sys.stderr)
    return md, png


def _env() -> None:
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def _sizes(value: str) -> list[str]:
    return [s.strip() for s in value.split(",") if s.strip() and s.strip() != "none"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    p.add_argument("--out", type=Path, default=Path("bench/results.json"), help="JSON results")
    p.add_argument(
        "--sizes",
        default=",".join(DEFAULT_SIZES),
        help=f"model sizes, comma-separated; {REAL_MODEL!r} is the real SmolLM2-135M-Instruct",
    )
    p.add_argument("--reps", type=int, default=5, help="repetitions of every measurement")
    p.add_argument(
        "--gen-sizes",
        default=",".join(DEFAULT_GEN_SIZES),
        help="sizes whose generation speed is measured per cpu_linear mode",
    )
    p.add_argument("--gen-tokens", type=int, default=16, help="tokens per prompt, generation")
    p.add_argument("--gen-reps", type=int, default=3, help="repetitions of the generation batch")
    p.add_argument(
        "--http-sizes", default=None, help="sizes pushed through vllm serve too (default: all)"
    )
    p.add_argument("--fsdp-size", default=FSDP_SIZE, help="FSDP2 vs DDP sync size ('none': skip)")
    p.add_argument("--fsdp-reps", type=int, default=4, help="syncs measured per FSDP/DDP job")
    p.add_argument(
        "--inflight-size", default=INFLIGHT_SIZE, help="in-flight pushes' size ('none': skip)"
    )
    p.add_argument("--inflight-pushes", type=int, default=8, help="pushes per in-flight mode")
    p.add_argument(
        "--recipe-steps", type=int, default=40, help="GRPO recipe steps, sync and async (0: skip)"
    )
    p.add_argument(
        "--quick", action="store_true", help="smoke run: 1m, 2 reps, no generation/HTTP/FSDP"
    )
    p.add_argument(
        "--workdir", type=Path, default=None, help="models and disk saves (default: tmp)"
    )
    p.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"), help="tmpfs for save tests")
    p.add_argument("--keep", action="store_true", help="keep the built models")
    p.add_argument("--strict", action="store_true", help="exit 2 when a target is missed")
    p.add_argument("--render", type=Path, default=None, help="only redraw .md/.png of a JSON")
    p.add_argument(
        "--sync-sizes",
        default="100m,smollm2",
        help="sizes of the 'sync end to end' section (benchmarks.sync; 'none': skip)",
    )
    p.add_argument(
        "--sync-reps",
        type=int,
        default=9,
        help="syncs timed per variant of 'sync end to end' (more than --reps: on 2 cores a "
        "sync moves by 1x of the two-copy limit from one to the next)",
    )
    add_delta_arguments(p)
    p.add_argument(
        "--default-sizes",
        default="100m",
        help="sizes of the 'default sync' section (benchmarks.default_sync; 'none': skip)",
    )
    p.add_argument(
        "--only",
        choices=["sync", "vllm034", "delta", "default"],
        default=None,
        help="run this section alone and merge it into --out under its key",
    )
    p.add_argument("--_child", dest="child", default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _parser()
    args = p.parse_args(argv)
    if args.quick:  # the push paths on both engines and the in-flight pauses, nothing else
        args.sizes = ",".join(QUICK_SIZES)
        args.gen_sizes, args.http_sizes, args.fsdp_size = "none", "none", "none"
        args.reps = min(args.reps, 2)
        if args.inflight_size not in ("", "none"):
            args.inflight_size, args.inflight_pushes = QUICK_SIZES[0], min(args.inflight_pushes, 2)
        args.recipe_steps = 0  # the recipes' own tests run them
        args.sync_sizes = "none"
        args.delta_sizes = "none"
        args.default_sizes = "none"
    args.sizes = _sizes(args.sizes)
    args.gen_sizes = _sizes(args.gen_sizes)
    args.sync_sizes = _sizes(args.sync_sizes)
    args.delta_sizes = _sizes(args.delta_sizes)
    args.default_sizes = _sizes(args.default_sizes)
    args.delta_lrs = [float(x) for x in _sizes(args.delta_lrs)]
    args.http_sizes = args.sizes if args.http_sizes is None else _sizes(args.http_sizes)
    args.fsdp_size = None if args.fsdp_size in ("", "none") else args.fsdp_size
    args.inflight_size = None if args.inflight_size in ("", "none") else args.inflight_size
    from weight_bridge.testing.models import SIZES

    known = [*SIZES, REAL_MODEL]
    unknown = [
        s for s in [*args.sizes, *([args.fsdp_size] if args.fsdp_size else [])] if s not in known
    ]
    if unknown or args.fsdp_size == REAL_MODEL:
        p.error(f"unknown sizes {unknown or [args.fsdp_size]}; choose from {known}")
    if args.reps < 1:
        p.error("--reps must be at least 1")
    return args


def _header(args: argparse.Namespace, raw_argv: list[str], workdir: Path) -> dict[str, Any]:
    return {
        "schema": 2,
        "command": shlex.join([sys.executable, "-m", "benchmarks", *raw_argv]),
        "make_target": "make bench  (= .venv/bin/python -m benchmarks --out bench/results.json)",
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "versions": versions(),
        "settings": {
            "sizes": args.sizes,
            "reps": args.reps,
            "gen_sizes": args.gen_sizes,
            "gen_tokens": args.gen_tokens,
            "gen_reps": args.gen_reps,
            "gen_batch": GEN_BATCH,
            "http_sizes": args.http_sizes,
            "fsdp_size": args.fsdp_size,
            "fsdp_reps": args.fsdp_reps,
            "sync_reps": args.sync_reps,
            "delta_sizes": args.delta_sizes,
            "delta_lrs": args.delta_lrs,
            "delta_steps": args.delta_steps,
            "default_sizes": args.default_sizes,
            "inflight_size": args.inflight_size,
            "inflight_pushes": args.inflight_pushes,
            "recipe_steps": args.recipe_steps,
            "engine_kwargs": ENGINE_KWARGS,
            "arch": ARCH,
            "workdir": str(workdir),
            "workdir_fs": fs_type(workdir),
            "env": {
                k: os.environ.get(k)
                for k in ("VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE", "OMP_NUM_THREADS")
            },
            "quick": args.quick,
        },
        "targets": TARGETS,
        "sizes": {},
    }


def _summarise(results: dict[str, Any], sizes: list[str]) -> None:
    last = results["sizes"][sizes[-1]]
    machine = results["machine"]
    for eng in ENGINES:
        machine[f"copy_bandwidth_{eng}_bytes_per_s"] = dig(last, eng, "copy", "rate_bytes_per_s")
    machine["copy_bandwidth_bytes_per_s"] = (
        machine["copy_bandwidth_multiprocess_bytes_per_s"]
        or machine["copy_bandwidth_inprocess_bytes_per_s"]
    )
    machine["copy_bandwidth_note"] = (
        "payload bytes per second of the copy_ limit (every tensor of the largest size, "
        "between preallocated tensors) inside the engine's worker process; memory traffic is "
        "about twice that (read + write)"
    )
    sizes_ = results["sizes"].values()
    results["correctness_passed"] = all(s["correctness"]["passed"] for s in sizes_)
    results["errors"] = [f"{n}: {e}" for n, s in results["sizes"].items() for e in s["errors"]]
    fsdp = results.get("fsdp")
    if isinstance(fsdp, dict) and "error" in fsdp:
        results["errors"].append(f"fsdp: {fsdp['error'][-2000:]}")
    inflight = results.get("inflight")
    if isinstance(inflight, dict) and "error" in inflight:
        results["errors"].append(f"inflight: {inflight['error'][-2000:]}")
    results["targets_missed"] = [
        f"{n}: {k}"
        for n, s in results["sizes"].items()
        for k, t in s["targets"].items()
        if t["met"] is False
    ]
    delta = results.get("delta")
    if isinstance(delta, dict):
        from .delta_report import missed

        errors = [f"delta {n}: {s['error']}" for n, s in delta["sizes"].items() if "error" in s]
        results["errors"] += errors
        results["targets_missed"] += [f"delta {m}" for m in missed(delta)]


def _run(args: argparse.Namespace, raw_argv: list[str]) -> dict[str, Any]:
    """Every size, then the FSDP section; partial results written after each."""
    t0 = time.perf_counter()
    load = CpuLoad()
    own_workdir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="wb-bench-")) if own_workdir else args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    results = _header(args, raw_argv, workdir)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        for size in args.sizes:
            results["sizes"][size] = bench_size(size, args, workdir)
            results["elapsed_s"], results["load"] = time.perf_counter() - t0, load.report()
            args.out.write_text(json.dumps(results, indent=1, default=str))  # partial results
        if args.fsdp_size:
            results["fsdp"] = bench_fsdp_section(args, workdir)
        if args.inflight_size:
            results["inflight"] = bench_inflight_section(args, workdir)
        if args.sync_sizes:
            results["sync"] = bench_sync_section(args, workdir)
        if args.delta_sizes:
            from .delta import delta_section

            results["delta"] = delta_section(args, workdir)
        if args.default_sizes:
            from .default_sync import default_section

            results["default"] = default_section(args, workdir)
    finally:
        if own_workdir and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    _summarise(results, args.sizes)
    results["elapsed_s"], results["load"] = time.perf_counter() - t0, load.report()
    return results


def main(argv: list[str] | None = None) -> int:
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw_argv)
    _env()
    if args.child is not None:
        from .child import child_multiprocess

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        spec = json.loads(Path(args.child).read_text())
        args.out.write_text(json.dumps(child_multiprocess(spec), default=str))
        return 0
    if args.render is not None:
        rendered = json.loads(args.render.read_text())
        for p in write_outputs(rendered, args.render):
            print(p)
        return 0
    # In-process engines here; the multi-process engine runs in a child (vLLM caches its env).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.only is not None:
        return _run_only(args)
    results = _run(args, raw_argv)
    args.out.write_text(json.dumps(results, indent=1, default=str))
    md, png = write_outputs(results, args.out)
    print(md.read_text())
    print(f"wrote {args.out}, {md}, {png} in {results['elapsed_s']:.0f} s")
    if not results["correctness_passed"] or results["errors"]:
        print("CORRECTNESS CHECK FAILED or a measurement raised; see the results", file=sys.stderr)
        return 1
    if args.strict and results["targets_missed"]:
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
