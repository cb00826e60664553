"""Benchmark: other clients of a served engine while a trainer pushes (the ``openai`` package).

    python -m benchmarks.clients --out bench/results-clients.json          # 10m, 30 s a phase
    python -m benchmarks.clients --size 1m --seconds 6 --out /tmp/c.json   # smoke run

One ``vllm serve`` process with the bridge (:class:`~weight_bridge.vllm.clients.served.VLLMServer`)
on a Llama of ``size``. Clients of the ``openai`` package (``max_retries=0``: a failed request is
an error, never hidden by a retry) send completions at a fixed rate (``--rate`` a second, open
loop: each request starts at its scheduled time on a thread of its own, whatever the earlier
ones do; every other request streamed), ``--max-tokens`` tokens each, for ``--seconds`` a phase.
Phases, one after the other on the same server: no pushes, then each in-flight mode (``None``,
``recompute``, ``keep``, ``drain``) with the trainer side (:class:`~weight_bridge.vllm.
clients.http.HTTPClient`) pushing B and A alternately every ``--every`` seconds.

Per phase: requests sent and completed, errors (target 0), latency p50 and p99 (request sent to
last token), the pause the clients saw (the longest time in which no request completed, beside
the same figure with no pushes), tokens per second, and the pushes made. Reported, never
asserted; the exit code is 1 if a client saw an error or a push failed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .section import run_section

__all__ = ["bench_clients", "main", "render"]

MODES: tuple[str | None, ...] = (None, "recompute", "keep", "drain")


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _request(sdk: Any, model: str, stream: bool, max_tokens: int) -> int:
    """One completion; the tokens it returned."""
    body = {"model": model, "prompt": [1, 20, 21, 22], "max_tokens": max_tokens}
    if not stream:
        answer = sdk.completions.create(**body)
        return int(answer.usage.completion_tokens)
    chunks = list(sdk.completions.create(**body, stream=True))
    return sum(1 for c in chunks if c.choices and c.choices[0].text is not None)


def _phase(sdk: Any, model: str, args: argparse.Namespace, push: Any) -> dict[str, Any]:
    """``args.seconds`` of open-loop load; ``push()`` every ``args.every`` seconds (None: no
    pushes)."""
    done: list[tuple[float, float, int]] = []  # (finished at, latency, tokens)
    errors: list[str] = []
    lock = threading.Lock()

    def one(stream: bool) -> None:
        started = time.perf_counter()
        try:
            tokens = _request(sdk, model, stream, args.max_tokens)
        except Exception as exc:
            with lock:
                errors.append(f"{type(exc).__name__}: {exc}"[:300])
            return
        now = time.perf_counter()
        with lock:
            done.append((now, now - started, tokens))

    threads: list[threading.Thread] = []
    pushes: list[float] = []
    push_errors: list[str] = []
    begin = time.perf_counter()
    next_push = begin + args.every
    n = 0
    while (now := time.perf_counter()) < begin + args.seconds:
        if push is not None and now >= next_push:
            started = time.perf_counter()
            try:
                push()
                pushes.append(time.perf_counter() - started)
            except Exception as exc:
                push_errors.append(f"{type(exc).__name__}: {exc}"[:300])
            next_push = time.perf_counter() + args.every
            continue
        due = begin + n / args.rate
        if now >= due:
            thread = threading.Thread(target=one, args=(n % 2 == 1,), daemon=True)
            thread.start()
            threads.append(thread)
            n += 1
            continue
        time.sleep(min(0.005, due - now))
    for thread in threads:
        thread.join(300)
    ends = sorted(t for t, _, _ in done)
    gaps = [b - a for a, b in zip([begin, *ends], ends, strict=False)]
    latencies = [lat for _, lat, _ in done]
    wall = (ends[-1] - begin) if ends else args.seconds
    return {
        "sent": n,
        "completed": len(done),
        "errors": len(errors),
        "error_examples": errors[:3],
        "latency_p50_s": _quantile(latencies, 0.5),
        "latency_p99_s": _quantile(latencies, 0.99),
        "longest_gap_s": max(gaps, default=None),
        "tokens_per_s": sum(t for _, _, t in done) / wall,
        "pushes": len(pushes),
        "push_median_s": _quantile(pushes, 0.5),
        "push_errors": push_errors,
    }


def bench_clients(workdir: Path, args: argparse.Namespace, log: Any = print) -> dict[str, Any]:
    """Every phase on one server; the section's result."""
    import openai

    from weight_bridge.vllm.clients.http import HTTPClient
    from weight_bridge.vllm.clients.served import VLLMServer
    from weight_bridge.vllm.options import BridgeOptions

    from .measure import build_models
    from .serve import server_args

    model_a, model_b = build_models(workdir, args.size)
    files = [model_b / "model.safetensors", model_a / "model.safetensors"]
    options = BridgeOptions(checkpoint_root=str(workdir))
    server = VLLMServer(model_a, options, server_args(), log=workdir / "serve.log").start()
    result: dict[str, Any] = {"size": args.size, "rate": args.rate, "seconds": args.seconds}
    result.update(every_s=args.every, max_tokens=args.max_tokens, phases={})
    try:
        trainer = HTTPClient(server.url, inflight=None)
        sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        model = sdk.models.list().data[0].id
        _request(sdk, model, False, args.max_tokens)  # warm
        count = [0]

        def pusher(mode: str | None) -> Any:
            def push() -> None:
                count[0] += 1
                trainer.push(files[count[0] % 2], version=str(count[0]), inflight=mode)

            return push

        log("clients: no pushes ...")
        result["phases"]["no pushes"] = _phase(sdk, model, args, None)
        for mode in MODES:
            log(f"clients: pushes with inflight={mode} ...")
            result["phases"][f"inflight={mode}"] = _phase(sdk, model, args, pusher(mode))
    finally:
        server.stop()
    return result


def render(result: dict[str, Any]) -> str:
    """The markdown table of a result."""
    lines = [
        "| phase | sent | completed | errors | p50 s | p99 s | longest gap s | tokens/s | pushes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, p in result["phases"].items():
        cells = [
            name,
            p["sent"],
            p["completed"],
            p["errors"],
            f"{p['latency_p50_s']:.3f}" if p["latency_p50_s"] is not None else "-",
            f"{p['latency_p99_s']:.3f}" if p["latency_p99_s"] is not None else "-",
            f"{p['longest_gap_s']:.3f}" if p["longest_gap_s"] is not None else "-",
            f"{p['tokens_per_s']:.1f}",
            p["pushes"],
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="10m")
    parser.add_argument("--rate", type=float, default=4.0, help="requests a second")
    parser.add_argument("--seconds", type=float, default=30.0, help="per phase")
    parser.add_argument("--every", type=float, default=3.0, help="seconds between pushes")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--render", type=Path, help="only redraw the .md of a results JSON")
    args = parser.parse_args(argv)

    def run() -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="bench-clients-") as tmp:
            return bench_clients(Path(tmp), args)

    result = run_section(run, render, args.out, args.render)
    if result is None:
        return 0
    failed = any(p["errors"] or p["push_errors"] for p in result["phases"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
