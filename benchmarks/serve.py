"""The HTTP overhead of a push: the same push through a ``vllm serve`` process.

A server with the ``weight_bridge`` backend (:class:`~weight_bridge.vllm.clients.served.VLLMServer`,
the same engine arguments, vLLM's default multi-process engine) on A, alive beside the
benchmark's multi-process :class:`~weight_bridge.vllm.ColocatedEngine`. Interleaved
round-robin, the same checkpoints pushed into each:

* ``http``: :class:`~weight_bridge.vllm.clients.http.HTTPClient` ``push`` (``/start_weight_update``,
  ``/update_weights``, ``/finish_weight_update``; no pause, ``inflight=None``);
* ``engine``: ``ColocatedEngine.push`` into the multi-process engine;
* ``http_tiny`` / ``engine_tiny``: a partial push of one small tensor each way (the fixed
  cost of a push, where the HTTP round trips show most).

Afterwards the server's greedy tokens (``/inference/v1/generate``) must equal those of the
multi-process engine after the same push.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .config import ENGINE_KWARGS, PARITY_PROMPTS, PARITY_TOKENS
from .engines import greedy, push
from .levers import tiny_files
from .stats import Rounds

__all__ = ["measure_http", "server_args"]


def server_args() -> list[str]:
    """:data:`~.config.ENGINE_KWARGS` as ``vllm serve`` arguments."""
    args = [
        "--dtype",
        ENGINE_KWARGS["dtype"],
        "--max-model-len",
        str(ENGINE_KWARGS["max_model_len"]),
    ]
    args += [
        "--seed",
        str(ENGINE_KWARGS["seed"]),
        "--max-num-seqs",
        str(ENGINE_KWARGS["max_num_seqs"]),
    ]
    return args + (["--enforce-eager"] if ENGINE_KWARGS.get("enforce_eager") else [])


def _http_push(client: Any, file: Path, version: str) -> dict[str, float]:
    t0 = time.perf_counter()
    client.push(file, version=version)
    return {"elapsed_s": time.perf_counter() - t0}


def _http_tokens(client: Any) -> list[list[int]]:
    """Greedy tokens of the parity prompts, over HTTP."""
    sampling = {"max_tokens": PARITY_TOKENS, "temperature": 0.0, "ignore_eos": True}
    return [g.completions[0].token_ids for g in client.generate(PARITY_PROMPTS, sampling)]


def measure_http(
    engine: Any, a: Path, b: Path, reps: int, log: Callable[[str], None]
) -> dict[str, Any]:
    """See the module docstring; the engine ends on B."""
    from weight_bridge.vllm.clients.http import HTTPClient
    from weight_bridge.vllm.clients.served import VLLMServer
    from weight_bridge.vllm.options import BridgeOptions

    fa, fb = a / "model.safetensors", b / "model.safetensors"
    options = BridgeOptions(checkpoint_root=str(a.parent))
    log("  vllm serve: starting")
    started = time.perf_counter()
    server = VLLMServer(a, options, server_args(), log=a.parent / "serve.log").start()
    out: dict[str, Any] = {"startup_s": time.perf_counter() - started}
    try:
        client = HTTPClient(server.url, inflight=None)
        tiny = tiny_files(a, "http")

        def file(rep: int) -> Path:
            return fb if rep % 2 == 0 else fa

        methods: dict[str, Callable[[int], Any]] = {
            "http": lambda rep: _http_push(client, file(rep), str(rep)),
            "engine": lambda rep: push(engine, file(rep), str(rep)),
            "http_tiny": lambda rep: _http_push(
                client, tiny(str(client.version)), str(client.version)
            ),
            "engine_tiny": lambda rep: push(engine, tiny(str(engine.version)), str(engine.version)),
        }
        client.push(fa, version="A")  # both serve a version a tiny push can apply on
        push(engine, fa, "A")
        log(f"  HTTP against in-engine pushes ({reps} x {len(methods)})")
        rounds = Rounds()
        rounds.run(methods, reps)
        out.update({name: rounds.result(name) for name in methods})
        client.push(fb, version="B")
        push(engine, fb, "B")
        want = [tokens for tokens, _ in greedy(engine)]
        out["tokens_equal_engine"] = _http_tokens(client) == want
    finally:
        server.stop()
    return out
