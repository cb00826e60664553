"""One result type for generation: every client returns the same ``Generation``s.

The same rollout code (:func:`rollout`: greedy, ``logprobs=2``, prompt logprobs, a push
of the perturbed checkpoint B between two batches) is driven through a ``ColocatedEngine``, an
``AsyncColocatedEngine`` and a ``ServedEngine`` on the same tiny model: tokens, logprobs (within
1e-5), top-k, prompt logprobs, per-token versions and ``policy_version`` are equal across the
three, before and after the push. The canary, which scores prompt logprobs through the same
``generate``, passes over HTTP and catches a trainer whose weights the server does not serve.
The builders themselves are checked on plain data (no engine).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import ENGINE_KWARGS, close_engine

from weight_bridge.vllm.generation import Completion, Generation, VersionSpan

KINDS = ("colocated", "async", "serve")
PROMPTS = [[1, 20, 21, 22], [1, 5, 9, 30, 31], [1, 100, 101]]
SAMPLING = {"n": 1, "max_tokens": 6, "temperature": 0.0, "logprobs": 2, "prompt_logprobs": 1}
TOL = 1e-5  # float32 summation-order noise between engines batching differently
KV_CACHE_GB = 0.25  # the engines' KV cache (the suite's VLLM_CPU_KVCACHE_SPACE set aside)


def rollout(engine: Any, b: Path) -> dict[str, list[Generation]]:
    """What the test drives through every engine: a batch generated ahead (``submit``), a
    push of B, a batch generated when asked (``generate``)."""
    before = engine.submit(PROMPTS, SAMPLING).result()
    engine.push(b, version="B")
    after = engine.generate(PROMPTS, SAMPLING)
    return {"before": before, "after": after}


def _start(kind: str, model: Path) -> Any:
    from weight_bridge import AsyncColocatedEngine, ColocatedEngine, ServedEngine

    kwargs = dict(ENGINE_KWARGS, checkpoint_root=str(model.parent), kv_cache_gb=KV_CACHE_GB)
    kind_of = {"colocated": ColocatedEngine, "async": AsyncColocatedEngine, "serve": ServedEngine}
    env = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_gb
    try:
        return kind_of[kind](model, **kwargs)
    finally:
        if env is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = env


@pytest.fixture(scope="module")
def served(models) -> Iterator[Any]:
    """The one ``ServedEngine`` of this module (its own process), on A."""
    engine = _start("serve", models["llama_A"])
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def results(models, served) -> Callable[[str], dict[str, list[Generation]]]:
    """``results(kind)``: :func:`rollout` through that kind's engine, run once per module (the
    in-process engines one at a time: they cannot coexist in one process)."""
    done: dict[str, dict[str, list[Generation]]] = {}

    def get(kind: str) -> dict[str, list[Generation]]:
        if kind not in done:
            if kind == "serve":
                done[kind] = rollout(served, models["llama_B"])
            else:
                close_engine()  # the tests' shared in-process engine, if one is open
                with _start(kind, models["llama_A"]) as engine:
                    done[kind] = rollout(engine, models["llama_B"])
        return done[kind]

    return get


def _close(got: float | None, want: float | None, where: str) -> None:
    assert (got is None) == (want is None), where
    if got is not None and want is not None:
        assert math.isclose(got, want, abs_tol=TOL), f"{where}: {got} vs {want}"


def assert_same(got: list[Generation], want: list[Generation], where: str) -> None:
    assert len(got) == len(want), where
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        at = f"{where} prompt {i}"
        assert g.prompt_token_ids == w.prompt_token_ids, at
        assert g.policy_version == w.policy_version, at
        assert g.prompt_logprobs is not None and w.prompt_logprobs is not None, at
        for j, (a, b) in enumerate(zip(g.prompt_logprobs, w.prompt_logprobs, strict=True)):
            _close(a, b, f"{at} prompt token {j}")
        assert len(g.completions) == len(w.completions) == SAMPLING["n"], at
        for gc, wc in zip(g.completions, w.completions, strict=True):
            assert gc.token_ids == wc.token_ids, at
            assert gc.versions == wc.versions and gc.spans == wc.spans, at
            assert gc.finish_reason == wc.finish_reason, at
            assert gc.logprobs is not None and wc.logprobs is not None, at
            assert gc.top_logprobs is not None and wc.top_logprobs is not None, at
            for step, (a, b) in enumerate(zip(gc.logprobs, wc.logprobs, strict=True)):
                _close(a, b, f"{at} step {step}")
            for step, (a, b) in enumerate(zip(gc.top_logprobs, wc.top_logprobs, strict=True)):
                assert list(a) == list(b), f"{at} step {step}: top-k {list(a)} vs {list(b)}"
                for token in a:
                    _close(a[token], b[token], f"{at} step {step} token {token}")


@pytest.mark.every_vllm
@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("kind", KINDS)
def test_every_client_returns_the_same_generations(kind: str, results) -> None:
    got = results(kind)
    for when, version in (("before", None), ("after", "B")):
        for g in got[when]:
            assert g.policy_version == version, (when, g.policy_version)
            for c in g.completions:
                assert c.versions == [version] * SAMPLING["max_tokens"], (when, c.versions)
                assert c.policy_version == version
                assert all(len(step) == SAMPLING["logprobs"] for step in c.top_logprobs or ())
                tops = c.top_logprobs or []
                assert c.logprobs == [s[t] for s, t in zip(tops, c.token_ids, strict=True)]
            assert g.prompt_logprobs is not None and g.prompt_logprobs[0] is None
    moved = [
        abs(a - b)
        for x, y in zip(got["before"], got["after"], strict=True)
        for a, b in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:], strict=True)  # type: ignore[index]
    ]
    assert max(moved) > 1e-3, "the push of B changed nothing"
    for other in KINDS:
        if other != kind:
            for when in ("before", "after"):
                assert_same(got[when], results(other)[when], f"{kind} vs {other}, {when}")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_canary_works_over_http(models, served, results) -> None:
    """The canary asks for prompt logprobs through the same sampling dict on any client: over
    HTTP it passes when the trainer holds what the server serves (B, after :func:`rollout`),
    and fails when it does not (A)."""
    import torch
    from transformers import AutoModelForCausalLM

    from weight_bridge.sync.canary import CanaryCheck, CanaryError

    results("serve")  # the server now serves B
    assert served.version == "B"
    b = AutoModelForCausalLM.from_pretrained(models["llama_B"], dtype=torch.float32)
    assert CanaryCheck().gap(b, served) < 1e-4
    a = AutoModelForCausalLM.from_pretrained(models["llama_A"], dtype=torch.float32)
    with pytest.raises(CanaryError, match="differ from the trainer's"):
        CanaryCheck().gap(a, served)


# -- the builders, on plain data ---------------------------------------------------------------


def _lp(value: float) -> SimpleNamespace:
    return SimpleNamespace(logprob=value)


def test_the_builders_read_vllm_outputs_and_json_alike() -> None:
    """A ``RequestOutput`` (duck-typed) and the JSON of ``/inference/v1/generate`` for the same
    generation give equal ``Generation``s; ``"default"`` becomes None, ``top_logprobs`` keeps
    ``max(k, 1)`` per step, the sampled token first, as vLLM's server sends them."""
    span = SimpleNamespace
    output = SimpleNamespace(
        prompt_token_ids=[1, 7],
        prompt_logprobs=[None, {7: _lp(-0.5), 3: _lp(-1.0)}],
        num_cached_tokens=0,
        outputs=[
            SimpleNamespace(
                token_ids=[4, 9],
                logprobs=[{4: _lp(-0.1), 5: _lp(-2.0)}, {9: _lp(-3.0), 2: _lp(-0.2), 6: _lp(-4)}],
                weight_versions=[
                    span(start=0, end=1, version="default"),
                    span(start=1, end=2, version="3"),
                ],
                finish_reason="length",
            )
        ],
    )
    body = {
        "choices": [
            {
                "index": 0,
                "token_ids": [4, 9],
                "finish_reason": "length",
                "logprobs": {
                    "content": [
                        {
                            "token_id": 4,
                            "logprob": -0.1,
                            "top_logprobs": [
                                {"token_id": 4, "logprob": -0.1},
                                {"token_id": 5, "logprob": -2.0},
                            ],
                        },
                        {
                            "token_id": 9,
                            "logprob": -3.0,
                            "top_logprobs": [
                                {"token_id": 9, "logprob": -3.0},
                                {"token_id": 2, "logprob": -0.2},
                            ],
                        },
                    ]
                },
                "weight_versions": [
                    {"start": 0, "end": 1, "version": "default"},
                    {"start": 1, "end": 2, "version": "3"},
                ],
            }
        ],
        "prompt_logprobs": [None, {"7": {"logprob": -0.5}, "3": {"logprob": -1.0}}],
        "usage": {"prompt_tokens_details": {"cached_tokens": 0}},
    }
    want = Generation(
        prompt_token_ids=[1, 7],
        completions=[
            Completion(
                token_ids=[4, 9],
                logprobs=[-0.1, -3.0],
                top_logprobs=[{4: -0.1, 5: -2.0}, {9: -3.0, 2: -0.2}],
                spans=[VersionSpan(0, 1, None), VersionSpan(1, 2, "3")],
                finish_reason="length",
            )
        ],
        prompt_logprobs=[None, -0.5],
        num_cached_tokens=0,
        policy_version="3",
    )
    assert Generation.from_request_output(output, top=2) == want
    assert Generation.from_json(body, [1, 7]) == want
    assert want.completions[0].versions == [None, "3"]
    # No spans reported: every token is the fallback's; no logprobs asked: None.
    bare = SimpleNamespace(token_ids=[4], logprobs=None, weight_versions=None, finish_reason=None)
    plain = SimpleNamespace(
        prompt_token_ids=[1], prompt_logprobs=None, num_cached_tokens=None, outputs=[bare]
    )
    got = Generation.from_request_output(plain, fallback="default")
    assert got.completions[0].logprobs is None and got.completions[0].versions == [None]
    assert got.policy_version is None and got.prompt_logprobs is None
