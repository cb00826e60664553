"""Partial checkpoints: a subset of tensors applied on top of exactly the version it names.

Each partial push is judged against a cold start on the *equivalent full checkpoint* (the base
with the partial's tensors replaced), built as a model directory of its own. Partials touch a
tied weight (Qwen2's embeddings, shared with lm_head), fused targets (``q_proj`` into
``qkv_proj``, ``gate_proj`` into ``gate_up_proj``) and one MoE expert (the CPU experts
kernel's prepack refreshed).

FAULT INJECTION (the rollback case only): one weight loader raises mid-push, as in
``test_transactions.py``; a failure after writing started cannot be caused otherwise.
"""

from __future__ import annotations

import pytest
from helpers import (
    FAULT_PARAM,
    arm_write_fault,
    assert_differs,
    assert_parity,
    equivalent_full,
    greedy,
    partial_checkpoint,
    run_engine_check,
    tensors_of,
)

from weight_bridge.direct import DirectReloadError
from weight_bridge.testing.models import build_matrix_model, perturb_checkpoint


@pytest.mark.every_vllm
def test_partials_in_sequence_equal_cold_starts_and_a_wrong_base_is_refused(
    models, cold, engine_factory, tmp_path
) -> None:
    a, b = models["qwen2_A"], models["qwen2_B"]
    engine = engine_factory(a)
    addresses = engine.addresses()
    full = engine.push(a / "model.safetensors", version=1)
    assert not full.partial

    touched = [
        "model.embed_tokens.weight",  # tied with lm_head
        "model.layers.0.self_attn.q_proj.weight",  # one third of the fused qkv_proj
        "model.layers.1.mlp.gate_proj.weight",  # one half of the fused gate_up_proj
    ]
    first = partial_checkpoint(b, touched, "1", "2", tmp_path / "p2.safetensors")
    report = engine.push(first)
    assert report.partial and report.tensors == 3 and engine.version == "2"
    assert report.bytes < full.bytes / 3
    assert set(report.refreshed) <= {
        "model.embed_tokens",
        "lm_head",
        "model.layers.0.self_attn.qkv_proj",
        "model.layers.1.mlp.gate_up_proj",
    }
    assert_parity(greedy(engine), cold(equivalent_full(a, [(b, touched)], tmp_path / "m2")))

    rest = sorted(set(tensors_of(b)) - set(touched))
    second = partial_checkpoint(b, rest, "2", "3", tmp_path / "p3.safetensors")
    engine.push(second)
    served_b = greedy(engine)
    assert_parity(served_b, cold(b))
    assert engine.served_checkpoints == [str(a / "model.safetensors"), str(first), str(second)]

    stale = partial_checkpoint(a, touched, "2", "4", tmp_path / "p4.safetensors")
    with pytest.raises(DirectReloadError) as info:
        engine.push(stale)
    assert "version '2'" in str(info.value) and "version '3'" in str(info.value)
    assert engine.version == "3" and engine.undefined is None
    assert_parity(greedy(engine), served_b)

    # A failure mid-way through a partial push rolls back over the whole chain.
    engine.llm.collective_rpc(arm_write_fault)
    faulty = partial_checkpoint(a, [FAULT_PARAM], "3", "5", tmp_path / "p5.safetensors")
    with pytest.raises(DirectReloadError, match="rolled back to version '3'"):
        engine.push(faulty)
    assert engine.version == "3" and engine.undefined is None
    assert_parity(greedy(engine), served_b)

    # A complete checkpoint is a valid base at any time.
    engine.push(a / "model.safetensors", version=6)
    assert engine.served_checkpoints == [str(a / "model.safetensors")]
    assert_parity(greedy(engine), cold(a))
    assert engine.addresses() == addresses


def test_partial_refused_before_any_full_push_and_in_layerwise_mode(
    models, engine_factory, tmp_path
) -> None:
    a, b = models["llama_A"], models["llama_B"]
    engine = engine_factory(a)
    before = greedy(engine)
    names = ["model.layers.0.self_attn.q_proj.weight"]
    partial = partial_checkpoint(b, names, "0", "1", tmp_path / "p.safetensors")
    with pytest.raises(DirectReloadError, match="the weights it started with"):
        engine.push(partial)
    engine.push(a / "model.safetensors", version=0)
    engine.reload_mode = "layerwise"
    with pytest.raises(DirectReloadError, match="layerwise reload needs whole layers"):
        engine.push(partial)
    assert engine.version == 0 and engine.undefined is None
    assert_parity(greedy(engine), before)


@pytest.mark.slow
def test_partial_touching_one_moe_expert_refreshes_its_prepack(
    cold, engine_factory, tmp_path
) -> None:
    a = build_matrix_model(tmp_path / "moe_A", "qwen3-moe", seed=0)
    b = perturb_checkpoint(a, tmp_path / "moe_B", scale=0.3, seed=1)
    engine = engine_factory(a)
    engine.push(a / "model.safetensors", version=1)
    names = [n for n in tensors_of(b) if ".mlp.experts.1." in n and ".layers.0." in n]
    assert len(names) == 3  # gate, up and down of one expert
    report = engine.push(partial_checkpoint(b, names, "1", "2", tmp_path / "p.safetensors"))
    assert report.partial and list(report.refreshed.values()) == ["cpu MoE prepack"]
    assert_parity(greedy(engine), cold(equivalent_full(a, [(b, names)], tmp_path / "m")))


@pytest.mark.slow
def test_partial_push_in_the_multiprocess_tensor_parallel_engine(models, cold, tmp_path) -> None:
    """vLLM's default multi-process engine, two tensor-parallel ranks: each rank notes its own
    writes (the tied, vocabulary-sharded embedding and a fused slice) and refreshes them."""
    a, b = models["qwen2_A"], models["qwen2_B"]
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"]
    partial = partial_checkpoint(b, names, "0", "1", tmp_path / "p.safetensors")
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    r = run_engine_check("partial", str(a), str(partial), "--tp", "2", env=env)
    assert r["report"]["partial"] and r["report"]["workers"] == 2
    assert r["report"]["tensors"] == 2 and r["addresses_unchanged"]
    reference = run_engine_check(
        "cold", str(equivalent_full(a, [(b, names)], tmp_path / "m")), "--tp", "2", env=env
    )
    assert_parity(r["pushed"], reference["cold"])
    assert_differs(r["pushed"], cold(a))
