"""Sections that run each model size in a child process of its own.

Why: what a size's run leaves allocated (an engine's KV cache, a trainer's optimizer state,
glibc's arenas) goes with its process, so the next size starts on a quiet machine. The parent
(:func:`run_sizes`) starts ``python -m <module> --size S ... --out F`` per size and collects
``F``'s JSON; the child's ``main`` is :func:`child_main`, which sets the environment every
child runs in (vLLM's default multi-process engine, as users get it; a bounded KV cache;
nothing from a hub) and writes what its section's function returns, with the CPU load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .machine import CpuLoad

__all__ = ["child_main", "reps_child_main", "run_sizes", "section_in"]

_ROOT = Path(__file__).resolve().parents[1]


def run_sizes(
    module: str,
    sizes: list[str],
    options: list[str],
    workdir: Path,
    shm: Path,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Each size's result (``{"error": ...}`` for a child that failed), in order."""
    results: dict[str, Any] = {}
    for size in sizes:
        out = workdir / f"{module.rsplit('.', 1)[-1]}-{size}.json"
        cmd = [sys.executable, "-m", module, "--size", size, *options]
        cmd += ["--workdir", str(workdir), "--shm-dir", str(shm), "--out", str(out)]
        log(" ".join(cmd))
        done = subprocess.run(cmd, cwd=_ROOT, check=False)
        if done.returncode == 0 and out.exists():
            results[size] = json.loads(out.read_text())
        else:
            results[size] = {"error": f"exit code {done.returncode}"}
        log(f"{size}: load {os.getloadavg()}")
    return results


def child_main(
    prog: str,
    argv: list[str] | None,
    add_options: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace, Callable[[str], None]], dict[str, Any]],
) -> int:
    """A child's ``main``: the shared options (``--size``, ``--workdir``, ``--shm-dir``,
    ``--out``) and the section's own (``add_options``), the environment, then ``run(args,
    log)``'s result written to ``--out`` with the CPU load during it."""
    p = argparse.ArgumentParser(prog=f"python -m {prog}")
    p.add_argument("--size", required=True)
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"))
    p.add_argument("--out", type=Path, required=True)
    add_options(p)
    args = p.parse_args(argv)
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default, as users get it
    for key, value in (("VLLM_CPU_KVCACHE_SPACE", "1"), ("HF_HUB_OFFLINE", "1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tag = prog.rsplit(".", 1)[-1]

    def log(msg: str) -> None:
        print(f"[bench {tag}] {msg}", flush=True)

    load = CpuLoad()
    if args.out.exists():
        args.out.unlink()
    result = run(args, log)
    result["load"] = load.report()
    args.out.write_text(json.dumps(result, default=str))
    return 0


def reps_child_main(
    prog: str,
    argv: list[str] | None,
    bench_size: Callable[[str, Path, int, Path, Callable[[str], None]], dict[str, Any]],
) -> int:
    """:func:`child_main` of a section whose one option is ``--reps``:
    ``bench_size(size, workdir, reps, shm, log)``."""

    def options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--reps", type=int, default=7)

    def run(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
        return bench_size(args.size, args.workdir, args.reps, args.shm_dir, log)

    return child_main(prog, argv, options, run)


def section_in(
    workdir: Path, name: str, run: Callable[[Path, Callable[[str], None]], dict[str, Any]]
) -> dict[str, Any]:
    """``run(directory, log)`` of section ``name`` in a directory of its own under ``workdir``,
    removed afterwards; ``log`` prints ``[bench name] ...``."""

    def log(msg: str) -> None:
        print(f"[bench {name}] {msg}", flush=True)

    directory = workdir / name
    directory.mkdir(parents=True, exist_ok=True)
    try:
        return run(directory, log)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
