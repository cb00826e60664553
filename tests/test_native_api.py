"""vLLM's own RL API on ``vllm.LLM`` and ``AsyncLLM`` started with the ``weight_bridge`` backend.

Both in vLLM's default multi-process engine (a fresh process per mode, ``tests/native_check.py``),
on a tied dense Qwen2 (Qwen3-MoE through the same calls: ``test_serve.py``). References are cold
starts of a *stock* ``vllm.LLM`` (no bridge) on the same checkpoint: greedy tokens and top-3
logprobs to 1e-4. A refused checkpoint
makes ``update_weights`` raise the project's own error, naming the tensor, across vLLM's process
boundary; the engine keeps serving its version.
"""

from __future__ import annotations

import pytest
from helpers import (
    assert_differs,
    assert_labels_name_weights,
    assert_parity,
    assert_recompute_continues,
    label_colds,
    run_script,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def pairs(api_models):
    root, models = api_models
    return root, [models["dense"]]


def _run(mode: str, root, pairs) -> list[dict]:
    args = [str(p) for pair in pairs for p in pair]
    return run_script("native_check.py", mode, str(root), *args)[0]["engines"]


def _check_push_and_refusal(result: dict, a, b, stock_cold) -> None:
    assert_parity(result["a"], stock_cold(a))
    assert_parity(result["b"], stock_cold(b))
    assert_differs(result["b"], result["a"])
    refusal = result["refusal"]
    assert refusal["type"] == "DirectReloadError", refusal
    assert list(refusal["problems"]) == [result["nan_tensor"]]
    assert "NaN" in refusal["problems"][result["nan_tensor"]]


@pytest.mark.every_vllm
def test_vllm_llm_with_the_backend_multiprocess(pairs, stock_cold) -> None:
    """The tied dense pair; the MoE family's refresh through vLLM's calls in the multi-process
    engine is ``test_serve.py::test_the_moe_family_over_http``'s (the same engine core and
    worker, driven by the API server's ``AsyncLLM``)."""
    root, models = pairs
    for result, (a, b) in zip(_run("llm", root, models), models, strict=True):
        _check_push_and_refusal(result, a, b, stock_cold)
        assert result["version"] == "b" and result["version_after_refusal"] == "b"
        assert "after a failed update_weights" in result["finish_after_refusal"]  # no version
        assert_parity(result["after_refusal"], result["b"])
        second = result["second_start"]  # typed across vLLM's process boundary
        assert second["type"] == "UpdateConflictError" and second["in_progress"], second
        assert "a weight update is active since" in second["message"], second


def test_async_llm_with_the_backend_in_flight(pairs, stock_cold) -> None:
    """Push, refusal, then long generations interrupted by a push in ``recompute`` mode (two
    spans each, the tokens after the update a stock cold start's continuation on B) and by a
    refused push (every sequence finishes on the version it started on, as a cold start). The
    tied dense pair: the MoE family's refresh through ``AsyncLLM``'s calls in the multi-process
    engine is ``test_serve.py::test_the_moe_family_over_http``'s (the API server's ``AsyncLLM``)."""
    root, models = pairs
    for result, (a, b) in zip(_run("async", root, models), models, strict=True):
        _check_push_and_refusal(result, a, b, stock_cold)
        assert result["version_after_refusal"] == "b"
        prompts = result["prompts"]
        assert result["recompute_outcome"]["paused_s"] is not None
        outputs = [result["recompute"][str(i)] for i in range(len(prompts))]
        outputs = [(tokens, [tuple(s) for s in spans]) for tokens, spans in outputs]
        assert_recompute_continues(prompts, outputs, b, stock_cold, 96)
        assert result["refused_outcome"]["type"] == "DirectReloadError"
        on_a = stock_cold(a, prompts, max_tokens=96, ignore_eos=True)
        for i in range(len(prompts)):
            tokens, spans = result["refused"][str(i)]
            assert [s[0] for s in spans] == ["kept"] and tokens == on_a[i][0]


@pytest.mark.every_vllm
def test_async_llm_labels_name_the_weights_in_every_mode(api_models, stock_cold) -> None:
    """``AsyncLLM`` (multi-process) generating without a break while A and B are pushed
    alternately: in every in-flight mode, ``None`` included, each output under one version is
    that version's stock cold start and spans cover every token; a push while another update
    is active is refused with the typed error and resumes nothing; an update whose trainer died
    is abandoned after ``update_timeout_s``, and the next push then works."""
    root, models = api_models
    a, b = models["dense"]
    result = run_script("native_check.py", "labels", str(root), str(a), str(b))[0]
    cold = label_colds(a, b, stock_cold)
    for mode, outputs in result["modes"].items():
        outputs = [(p, tokens, [tuple(s) for s in spans]) for p, tokens, spans in outputs]
        single, mixed = assert_labels_name_weights(outputs, cold)
        print(f"inflight={mode}: {single} single-version outputs, {mixed} spanning a push")
    second = result["second"]
    assert second["type"] == "UpdateConflictError" and second["in_progress"], second
    assert not result["paused_after_refusal"]  # it took no pause, so it resumed none
    assert result["version_after_second"] == "A"
    dead = result["dead"]
    assert dead["refusals"] == ["UpdateConflictError"], dead
    assert 3.0 - 0.5 <= dead["waited_s"] <= 3.0 + 10, dead  # native_check.UPDATE_TIMEOUT_S
    assert result["version_after_dead"] == "B"
    assert result["after_dead"] == [c[0] for c in cold["B"]]
