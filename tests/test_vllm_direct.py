"""``reload_mode="vllm-direct"``: vLLM's own direct reload (0.34+) writes, the bridge validates
first, audits, reads back, rolls back and labels; on a vLLM without one it is refused by name.

The reference is a cold start of the same checkpoint, on the installed vLLM."""

from __future__ import annotations

import pytest
from helpers import (
    FAULT_PARAM,
    arm_fault,
    arm_write_fault,
    assert_parity,
    equivalent_full,
    greedy,
    open_engine,
    partial_checkpoint,
)

from weight_bridge.direct import DirectReloadError
from weight_bridge.vllm.internals.vllm_direct import vllm_direct_missing

pytestmark = [pytest.mark.every_vllm, pytest.mark.slow]

needs_vllm_direct = pytest.mark.skipif(
    vllm_direct_missing() is not None, reason=f"{vllm_direct_missing()}"
)


@needs_vllm_direct
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_vllm_direct_equals_a_cold_start(api_models, cold, kind) -> None:
    """Tied Qwen2 and Qwen3-MoE: B, then A again, each equal to its cold start; every weight the
    bridge proved read back; no address moved."""
    _, pairs = api_models
    a, b = pairs[kind]
    engine = open_engine(a, reload_mode="vllm-direct")
    addresses = engine.addresses()
    report = engine.push(b, version=1)
    assert report.mode == "vllm-direct"
    assert report.reprocessed == {"<all>": "vLLM's direct reload (post-load processing re-run)"}
    assert report.verified_writes == report.tensors
    assert_parity(greedy(engine), cold(b))
    engine.push(a, version=2)
    assert_parity(greedy(engine), cold(a))
    assert engine.addresses() == addresses
    assert engine.version == 2


@needs_vllm_direct
def test_vllm_direct_rolls_back_a_failed_write(api_models, cold, tmp_path) -> None:
    """A loader fault mid-way through vLLM's direct reload: rolled back to the version served,
    the engine equal to its cold start; a partial checkpoint and a bad tensor are refused before
    any write."""
    from safetensors.torch import load_file

    from weight_bridge.checkpoint import save_checkpoint

    _, pairs = api_models
    a, b = pairs["dense"]
    engine = open_engine(a, reload_mode="vllm-direct")
    engine.push(a, version=5)
    engine.llm.collective_rpc(arm_write_fault)
    with pytest.raises(DirectReloadError, match="rolled back to version '5'"):
        engine.push(b, version=6)
    assert engine.version == 5 and engine.undefined is None
    assert_parity(greedy(engine), cold(a))

    tensors = load_file(b / "model.safetensors")
    tensors[FAULT_PARAM] = tensors[FAULT_PARAM][:-1].clone()
    save_checkpoint(tensors, tmp_path / "bad.safetensors")
    with pytest.raises(DirectReloadError) as refused:
        engine.push(tmp_path / "bad.safetensors", version=7)
    assert FAULT_PARAM in refused.value.problems
    assert engine.version == 5
    assert_parity(greedy(engine), cold(a))


@needs_vllm_direct
@pytest.mark.parametrize(
    ("action", "words"),
    [("skip", "not written by vLLM's direct reload"), ("clobber", "read-back failed")],
)
def test_vllm_direct_catches_a_skipped_or_changed_write(api_models, cold, action, words) -> None:
    """A loader that skips its tensor, or whose write is changed after it: caught before vLLM's
    finish by the bridge's checks, named, rolled back to the version served."""
    _, pairs = api_models
    a, b = pairs["dense"]
    engine = open_engine(a, reload_mode="vllm-direct")
    engine.push(a, version=8)
    engine.llm.collective_rpc(lambda worker: arm_fault(worker, FAULT_PARAM, action))
    with pytest.raises(DirectReloadError, match=words) as failed:
        engine.push(b, version=9)
    assert "rolled back to version '8'" in str(failed.value)
    assert FAULT_PARAM in failed.value.problems, failed.value.problems
    assert engine.version == 8 and engine.undefined is None
    assert_parity(greedy(engine), cold(a))


@needs_vllm_direct
def test_vllm_direct_rolls_back_over_a_partial_link(api_models, cold, tmp_path) -> None:
    """A chain served as a complete checkpoint plus a partial one pushed in the bridge's own
    mode: a failed ``vllm-direct`` push rolls back over both (the partial link re-written by the
    bridge's writer), equal to the cold start on the equivalent full checkpoint."""
    _, pairs = api_models
    a, b = pairs["dense"]
    engine = open_engine(a, reload_mode="vllm-direct")
    engine.push(a, version=1)
    names = ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]
    engine.reload_mode = "direct"
    engine.push(partial_checkpoint(b, names, "1", "2", tmp_path / "p2.safetensors"))
    engine.reload_mode = "vllm-direct"
    with pytest.raises(DirectReloadError, match="partial checkpoint cannot ride"):
        engine.push(partial_checkpoint(b, names, "2", "3", tmp_path / "p3.safetensors"))
    engine.llm.collective_rpc(arm_write_fault)
    with pytest.raises(DirectReloadError, match="rolled back to version '2'"):
        engine.push(b, version=4)
    assert engine.version == "2" and engine.undefined is None
    assert_parity(greedy(engine), cold(equivalent_full(a, [(b, names)], tmp_path / "a_p2")))


@pytest.mark.skipif(vllm_direct_missing() is None, reason="this vLLM has a direct reload")
def test_vllm_direct_is_refused_by_name_without_one(api_models, cold) -> None:
    _, pairs = api_models
    a, b = pairs["dense"]
    engine = open_engine(a, reload_mode="vllm-direct")
    with pytest.raises(DirectReloadError, match="has no direct reload of its own") as refused:
        engine.push(b, version=1)
    assert "nothing was written" in str(refused.value)
    assert engine.undefined is None
    assert_parity(greedy(engine), cold(a))
