"""vLLM 0.33+'s new contracts, kept on every tested vLLM (issue 40, item 3).

* ``drain`` never fails a request: from 0.33, vLLM's ``pause_generation(mode="wait")`` rejects
  every request that arrives while paused (``RetryableRequestError``, HTTP 503). Real engines
  (``AsyncColocatedEngine``; a real ``vllm serve`` through ``HTTPClient``) generate from four
  threads without a break while A and B are pushed alternately with ``drain``, and a probe
  submits a request each time it sees the engine paused: no request fails, every output is one
  version (drain lets running ones finish first) and equals that version's stock cold start,
  and each probe's request, submitted during the push, is the new version's.
* ``HTTPClient`` labels tokens through ``return_weight_versions`` on 0.33+ (``/v1/completions``,
  no ``--enable-scale-out`` needed): right after a push every token is the new version's, and
  the :class:`~weight_bridge.vllm.generation.Generation` equals the token-in/token-out route's.

(``ColocatedEngine``, a ``vllm.LLM``, never pauses: a push and a generate take turns on one lock,
so no request meets a pause; ``inflight`` must be None there.)
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    ENGINE_KWARGS,
    LABEL_PROMPTS,
    LABEL_TOKENS,
    assert_labels_name_weights,
    close_engine,
    label_colds,
    pushes_under_load,
)

from weight_bridge import HTTPClient
from weight_bridge.vllm.clients.served import VLLMServer
from weight_bridge.vllm.options import BridgeOptions

pytestmark = [pytest.mark.slow, pytest.mark.every_vllm, pytest.mark.timeout(1800)]

GREEDY = {"max_tokens": LABEL_TOKENS, "temperature": 0.0, "ignore_eos": True}
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "128", "--enforce-eager"]
SERVER_ARGS += ["--max-num-seqs", "8", "--seed", "0"]


def _labelled(generation: Any) -> tuple[list[int], list[tuple[str, int, int]]]:
    completion = generation.completions[0]
    return list(completion.token_ids), [(str(s.version), s.start, s.end) for s in completion.spans]


def drain_under_load(client: Any, is_paused: Callable[[], bool], a: Path, b: Path) -> tuple:
    """:func:`helpers.pushes_under_load` with ``drain`` pushes through ``client``; during each
    push a probe submits one request as soon as ``is_paused()``. Every output, and per push
    the version pushed with the probe's output (None: the probe never saw the pause)."""
    client.push(a, version="A")
    probes: list[tuple[str, Any]] = []

    def push(path: Path, version: str) -> None:
        pushed = threading.Event()
        seen: list[Any] = []

        def probe() -> None:
            while not pushed.is_set():
                if is_paused():
                    seen.append(client.submit([LABEL_PROMPTS[0]], GREEDY))
                    return
                time.sleep(0.002)

        thread = threading.Thread(target=probe, daemon=True)
        thread.start()
        client.push(path, version=version, inflight="drain")
        pushed.set()
        thread.join(60)
        probes.append((version, seen[0].result(timeout=120)[0] if seen else None))

    outputs = pushes_under_load(
        lambda ids: _labelled(client.generate([ids], GREEDY)[0]),
        push,
        {"B": b, "A": a},
        pushes=8,
    )
    return outputs, probes


def assert_drained(outputs: list, probes: list, cold: dict[str, list]) -> None:
    """No request failed (:func:`helpers.pushes_under_load` raises any error), each output is
    one version's cold start, and each probe submitted while paused is the pushed version's."""
    assert all(len(spans) == 1 for _, _, spans in outputs), [s for _, _, s in outputs]
    arrived = [(version, g) for version, g in probes if g is not None]
    assert len(arrived) >= len(probes) // 2, f"the probe saw {len(arrived)} of {len(probes)} pauses"
    for version, generation in arrived:
        tokens, spans = _labelled(generation)
        assert spans == [(version, 0, LABEL_TOKENS)] and tokens == list(cold[version][0][0])
    assert_labels_name_weights(outputs + [(0, *_labelled(g)) for _, g in arrived], cold)


def test_a_drain_push_fails_no_request_of_an_async_engine(api_models, stock_cold) -> None:
    from weight_bridge import AsyncColocatedEngine

    root, models = api_models
    a, b = models["dense"]
    close_engine()  # the tests' shared in-process engine, if one is open
    kwargs = dict(ENGINE_KWARGS, checkpoint_root=str(root), kv_cache_gb=0.25)
    env = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_gb
    try:
        engine = AsyncColocatedEngine(a, inflight="drain", **kwargs)
    finally:
        if env is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = env
    with engine:
        paused = lambda: engine.run(engine.engine.is_paused())  # noqa: E731
        outputs, probes = drain_under_load(engine, paused, a, b)
    assert_drained(outputs, probes, label_colds(a, b, stock_cold))


@pytest.fixture(scope="module")
def served(api_models) -> Iterator[dict]:
    """A ``vllm serve`` with the bridge on the tied dense Qwen2 (A), and a client of it."""
    root, models = api_models
    a, b = models["dense"]
    options = BridgeOptions(checkpoint_root=str(root))
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    log = root.parent / "serve-contracts.log"
    server = VLLMServer(a, options, SERVER_ARGS, env=env, log=log).start()
    yield {"client": HTTPClient(server.url, inflight=None), "a": a, "b": b}
    server.stop()


def test_a_drain_push_over_http_fails_no_request(served, stock_cold) -> None:
    client, a, b = served["client"], served["a"], served["b"]
    paused = lambda: client.call("is_paused", method="GET")["is_paused"]  # noqa: E731
    outputs, probes = drain_under_load(client, paused, a, b)
    assert_drained(outputs, probes, label_colds(a, b, stock_cold))


def test_http_labels_every_token_after_a_push(served, stock_cold) -> None:
    """Right after each push every token is labelled with its version and is that version's
    cold start; on vLLM 0.33+ through ``/v1/completions``, whose ``Generation`` (tokens,
    logprobs, top-k, prompt logprobs, spans) equals the token-in/token-out route's."""
    import vllm

    client, a, b = served["client"], served["a"], served["b"]
    cold = label_colds(a, b, stock_cold)
    sampling = {**GREEDY, "logprobs": 2, "prompt_logprobs": 1, "n": 1}
    reader = HTTPClient(client.url, inflight=None)  # pushed nothing: no fallback label
    tokens_in_out = HTTPClient(client.url, inflight=None)
    tokens_in_out._completions = False  # the route of vLLM 0.32 (the server has both)
    for path, version in ((b, "B"), (a, "A"), (b, "B2")):
        client.push(path, version=version)
        got = reader.generate(LABEL_PROMPTS, sampling)
        weights = cold["A" if version == "A" else "B"]
        for p, g in enumerate(got):
            assert g.policy_version == version
            assert _labelled(g) == (list(weights[p][0]), [(version, 0, LABEL_TOKENS)])
        if reader._completions:
            assert_same(tokens_in_out.generate(LABEL_PROMPTS, sampling), got)
    minor = tuple(int(x) for x in vllm.__version__.split(".")[:2])
    assert reader._completions == (minor >= (0, 33)), vllm.__version__


def assert_same(got: list, want: list) -> None:
    """Two routes' Generations of the same requests on the same weights: equal but for float
    noise between batches."""
    close = lambda x, y: x == y or math.isclose(x, y, abs_tol=1e-5)  # noqa: E731
    for g, w in zip(got, want, strict=True):
        assert (g.prompt_token_ids, g.policy_version) == (w.prompt_token_ids, w.policy_version)
        assert all(map(close, g.prompt_logprobs[1:], w.prompt_logprobs[1:]))
        assert g.prompt_logprobs[0] is None and w.prompt_logprobs[0] is None
        for gc, wc in zip(g.completions, w.completions, strict=True):
            assert (gc.token_ids, gc.spans, gc.finish_reason) == (
                wc.token_ids,
                wc.spans,
                wc.finish_reason,
            )
            assert all(map(close, gc.logprobs, wc.logprobs))
            for a, b in zip(gc.top_logprobs, wc.top_logprobs, strict=True):
                assert list(a) == list(b) and all(close(a[t], b[t]) for t in a)
