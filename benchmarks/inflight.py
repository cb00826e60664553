"""Sections "inflight" (in a child: ``AsyncLLM`` runs vLLM's multi-process engine): pauses of
pushes while generations run, per in-flight mode, and the GRPO recipe sync and async; and
"clients": ``openai`` clients of a ``vllm serve`` at a fixed rate while the trainer pushes, per
in-flight mode: errors (target 0), latency, gaps, tokens/s."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from . import harness
from .harness import MULTIPROCESSING, ROOT, build_models, child, logger, quantile, scratch, table

# fmt: off
MODES, NO_PAUSE = ("recompute", "keep", "drain"), "none"  # the key of inflight=None's row

def _stats(xs: list[float]) -> dict[str, Any]:
    return {"median_s": statistics.median(xs), "p95_s": quantile(xs, 0.95), "n": len(xs)}

class _Busy:
    """Keeps the engine generating until closed (batches of 8 prompts x 64 tokens)."""

    def __init__(self, engine: Any) -> None:
        from vllm import SamplingParams
        self.engine, self.stop, self.batches = engine, threading.Event(), 0
        self.sampling = SamplingParams(max_tokens=64, temperature=1.0, ignore_eos=True, seed=0)
        self.prompts = [{"prompt_token_ids": [1, 20 + i, 30 + i, 40 + i]} for i in range(8)]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            self.engine.submit(self.prompts, self.sampling).result()
            self.batches += 1

def inflight(workdir: str, size: str, pushes: int, steps: int) -> dict[str, Any]:
    """The pauses, then (``steps`` > 0) both recipes; a child's call."""
    from weight_bridge.testing.models import build_tiny_model, perturb_checkpoint
    from weight_bridge.vllm.clients.async_colocated import AsyncColocatedEngine
    work, log = Path(workdir), logger("inflight")
    a = build_tiny_model(work / f"{size}_A", arch="llama", size=size, seed=0)
    b = perturb_checkpoint(a, work / f"{size}_B", scale=0.3, seed=1)
    kwargs = dict(dtype="float32", max_model_len=128, enforce_eager=True, max_num_seqs=16)
    p: dict[str, Any] = {"size": size}
    with AsyncColocatedEngine(a, inflight=None, checkpoint_root=work, **kwargs) as engine:
        p["idle"] = _stats([engine.push(b if i % 2 == 0 else a, version=i).elapsed_s
                            for i in range(pushes)])
        log(f"idle push: {p['idle']}")
        for mode in (None, *MODES):
            busy, paused = _Busy(engine), []
            for i in range(pushes):
                while busy.batches == 0 and not busy.stop.is_set():
                    busy.stop.wait(0.01)  # generating for real before the first push
                report = engine.push(b if i % 2 == 0 else a, version=f"{mode}{i}", inflight=mode)
                paused.append(report.elapsed_s if mode is None else report.paused_s)
            busy.stop.set()
            busy.thread.join(300)
            p[mode or NO_PAUSE] = _stats(paused)
            log(f"{mode or NO_PAUSE}: paused {p[mode or NO_PAUSE]} ({busy.batches} batches)")
    if steps < 1:
        return {"pauses": p}  # pauses only (the quick run)
    recipes, recipe = {}, ROOT / "examples/grpo"
    for name, overlay in (("sync", None), ("async", "async.yaml")):
        configs = [recipe / "config.yaml", *([recipe / overlay] if overlay else [])]
        args = [sys.executable, str(recipe / "train.py"), "fit",  # the configs, then the steps
                *(x for c in configs for x in ("--config", str(c))), "--trainer.max_steps",
                str(steps)]
        done = subprocess.run(args, cwd=work, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"the {name} recipe failed:\n{done.stderr[-3000:]}")
        run = work / "runs" / ("grpo-async" if overlay else "grpo") / "summary.json"
        summary = json.loads(run.read_text())
        keep = ("steps", "steps_per_s", "reward_first", "reward_last", "staleness_tokens")
        recipes[name] = {k: summary.get(k) for k in keep}
        log(f"{name} recipe: {recipes[name]}")
    speedup = recipes["async"]["steps_per_s"] / recipes["sync"]["steps_per_s"]
    return {"pauses": p, "recipe": {**recipes, "speedup": speedup}}

def section(args: Any, workdir: Path) -> dict[str, Any]:
    return child("benchmarks.inflight:inflight", workdir / "inflight.json", {MULTIPROCESSING: None},
                 workdir=workdir, size=args.inflight_size, pushes=args.inflight_pushes,
                 steps=args.recipe_steps)

def render(result: dict[str, Any]) -> str:
    p, run = result["pauses"], result.get("pauses_run")
    rows = [["into an idle engine (the push itself)", p["idle"]]]
    if NO_PAUSE in p:  # runs before labels were stamped with the write did not measure it
        rows.append(["in flight, `None` (no pause; the push's own time: generation stops only "
                     "while the engine core runs the update between two steps)", p[NO_PAUSE]])
    rows += [[f"in flight, `{mode}`", p[mode]] for mode in MODES]
    lines = [f"In-flight pushes ({p['size']} Llama, AsyncColocatedEngine, {p['idle']['n']} "
             "pushes each):", "",
             *([f"Measured on their own: `{run['command']}`, {run['started']}: {run['why']}.", ""]
               if run else []),
             *table(["push", "generation paused, median", "p95"],
                    [[what, f"{s['median_s']:.3f} s", f"{s['p95_s']:.3f} s"] for what, s in rows])]
    if (r := result.get("recipe")) is not None:
        lines += ["", f"GRPO recipe, {r['sync']['steps']} steps each, one after the other:", "",
                  *table(["recipe", "steps/s", "reward first -> last", "tokens by staleness"], [
                      [name, f"{r[name]['steps_per_s']:.3f}", f"{r[name]['reward_first']:.3f} -> "
                       f"{r[name]['reward_last']:.3f}", r[name]["staleness_tokens"]]
                      for name in ("sync", "async")]),
                  f"\nasync / sync steps per second: {r['speedup']:.2f}x"]
    return "\n".join(lines)

def _request(sdk: Any, model: str, stream: bool, max_tokens: int) -> int:
    body = {"model": model, "prompt": [1, 20, 21, 22], "max_tokens": max_tokens}
    if not stream:
        return int(sdk.completions.create(**body).usage.completion_tokens)
    chunks = list(sdk.completions.create(**body, stream=True))
    return sum(1 for c in chunks if c.choices and c.choices[0].text is not None)

def _phase(sdk: Any, model: str, args: Any, push: Any) -> dict[str, Any]:
    """``args.seconds`` of open-loop load; ``push()`` every ``args.every`` seconds (None: none)."""
    done: list[tuple[float, float, int]] = []  # (finished at, latency, tokens)
    errors, lock = [], threading.Lock()

    def one(stream: bool) -> None:
        started = time.perf_counter()
        try:
            tokens, now = _request(sdk, model, stream, args.max_tokens), time.perf_counter()
            with lock:
                done.append((now, now - started, tokens))
        except Exception as exc:
            with lock:
                errors.append(f"{type(exc).__name__}: {exc}"[:300])
    threads, pushes, push_errors, n = [], [], [], 0
    begin = time.perf_counter()
    next_push = begin + args.every
    while (now := time.perf_counter()) < begin + args.seconds:
        if push is not None and now >= next_push:
            try:
                pushes.append(harness.timed(push))
            except Exception as exc:
                push_errors.append(f"{type(exc).__name__}: {exc}"[:300])
            next_push = time.perf_counter() + args.every
        elif now >= begin + n / args.rate:
            threads.append(threading.Thread(target=one, args=(n % 2 == 1,), daemon=True))
            threads[-1].start()
            n += 1
        else:
            time.sleep(min(0.005, begin + n / args.rate - now))
    for thread in threads:
        thread.join(300)
    ends, latencies = sorted(t for t, _, _ in done), [lat for _, lat, _ in done]
    gaps = [b - a for a, b in zip([begin, *ends], ends, strict=False)]
    wall = (ends[-1] - begin) if ends else args.seconds
    return {"sent": n, "completed": len(done), "errors": len(errors), "error_examples": errors[:3],
            "latency_p50_s": quantile(latencies, 0.5), "latency_p99_s": quantile(latencies, 0.99),
            "longest_gap_s": max(gaps, default=None),
            "tokens_per_s": sum(t for _, _, t in done) / wall,
            "pushes": len(pushes), "push_median_s": quantile(pushes, 0.5),
            "push_errors": push_errors}

def section_clients(args: Any, workdir: Path) -> dict[str, Any]:
    import openai

    from weight_bridge.vllm.clients.http import HTTPClient
    from weight_bridge.vllm.clients.served import VLLMServer
    from weight_bridge.vllm.options import BridgeOptions

    from .engines import server_args
    size, log = args.size or "10m", logger("clients")
    result: dict[str, Any] = {"size": size, "rate": args.rate, "seconds": args.seconds,
                              "every_s": args.every, "max_tokens": args.max_tokens, "phases": {}}
    with scratch(workdir / "clients") as work:
        a, b = build_models(work, size)
        options = BridgeOptions(checkpoint_root=str(work))
        server = VLLMServer(a, options, server_args(), log=work / "serve.log").start()
        try:
            trainer = HTTPClient(server.url, inflight=None)
            sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
            model = sdk.models.list().data[0].id
            _request(sdk, model, False, args.max_tokens)  # warm
            files, count = [b / "model.safetensors", a / "model.safetensors"], [0]
            def push(mode: str | None) -> None:
                count[0] += 1
                trainer.push(files[count[0] % 2], version=str(count[0]), inflight=mode)
            log("clients: no pushes ...")
            result["phases"]["no pushes"] = _phase(sdk, model, args, None)
            for mode in (None, *MODES):
                log(f"clients: pushes with inflight={mode} ...")
                result["phases"][f"inflight={mode}"] = _phase(sdk, model, args,
                                                              lambda mode=mode: push(mode))
        finally:
            server.stop()
    return result

def clients_failed(result: dict[str, Any]) -> bool:
    return any(p["errors"] or p["push_errors"] for p in result["phases"].values())

def render_clients(result: dict[str, Any]) -> str:
    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"
    rows = [[name, p["sent"], p["completed"], p["errors"], s(p["latency_p50_s"]),
             s(p["latency_p99_s"]), s(p["longest_gap_s"]), f"{p['tokens_per_s']:.1f}", p["pushes"]]
            for name, p in result["phases"].items()]
    return "\n".join(table(["phase", "sent", "completed", "errors", "p50 s", "p99 s",
                            "longest gap s", "tokens/s", "pushes"], rows)) + "\n"
# fmt: on
