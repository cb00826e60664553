"""The architecture matrix: every family vLLM's CPU backend serves, pushed against a cold start.

Tiny random models built from ``transformers``' own config classes (dense tied and untied,
fused qkv / gate_up checkpoints, mixture-of-experts with the CPU experts kernel's prepack, and
DeepSeek-V2's MLA + MoE). One engine per family: started on A (its outputs then are A's cold
start), pushed B in ``direct`` mode, then A, then B again in ``auto`` mode, then a delta (5 % of
every tensor's elements moved back towards A); each time greedy tokens and top-3 logprobs equal
a cold start on the same checkpoint (to 1e-4; B's and the delta's in a fresh engine of its
own). A push either equals the cold start or is refused by
name; here every family is expected to be written directly (MoE experts refreshed).
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    assert_differs,
    assert_parity,
    delta_checkpoint,
    engine_cast,
    greedy,
    input_embedding_kernels,
    mixed,
    model_dir_with,
    run_engine_check,
    tensors_of,
)

from weight_bridge.direct import DirectReloadError
from weight_bridge.testing.models import (
    MATRIX,
    MOE_FAMILIES,
    build_matrix_model,
    perturb_checkpoint,
)


@pytest.fixture(scope="module")
def matrix_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("matrix")
    out = {}
    for family in MATRIX:
        a = build_matrix_model(root / f"{family}_A", family, seed=0)
        out[family] = (a, perturb_checkpoint(a, root / f"{family}_B", scale=0.3, seed=1))
    return out


# vLLM's Gemma2ForCausalLM computes its logits with its input embedding (tied), the others
# with an lm_head of their own: only there is the embedding's packed copy ever used.
LOGITS_FROM_EMBEDDING = ("gemma2",)

# ``make test-fast`` keeps one dense tied, one MoE and the MLA family; CI runs them all.
QUICK = ("qwen3-tied", "qwen3-moe", "deepseek-v2")


@pytest.mark.parametrize(
    "family",
    [  # the quick families run on every tested vLLM
        pytest.param(f, marks=pytest.mark.every_vllm if f in QUICK else pytest.mark.slow)
        for f in MATRIX
    ],
)
def test_family_push_equals_cold_start_in_direct_and_auto(
    family, matrix_models, cold, engine_factory, tmp_path
) -> None:
    a, b = matrix_models[family]
    engine = engine_factory(a)
    embeddings = engine.llm.collective_rpc(input_embedding_kernels)[0]
    assert set(embeddings.values()) == {"first use"}  # not packed at load
    cold_a = greedy(engine)  # the engine has just loaded A: its own cold start
    addresses = engine.addresses()
    assert not engine.plan()[0]["problems"], "a family of the matrix is expected writable"

    report = engine.push(b, version=1)
    assert report.mode == "direct" and report.verified_writes > 0
    # Packed again by the push only where generation used it, so it never waits for a pack.
    used = "packed" if family in LOGITS_FROM_EMBEDDING else "first use"
    assert engine.llm.collective_rpc(input_embedding_kernels)[0] == dict.fromkeys(embeddings, used)
    if family in MOE_FAMILIES:
        assert "cpu MoE prepack" in report.refreshed.values()
    got_b = greedy(engine)
    assert_parity(got_b, cold(b))
    assert_differs(got_b, cold_a)
    engine.push(a, version=2)
    assert_parity(greedy(engine), cold_a)

    engine.reload_mode = "auto"
    report = engine.push(b, version=3)
    assert report.mode == "direct" and not report.reprocessed
    assert_parity(greedy(engine), cold(b))

    # a delta back towards A: O(changed) writes at the offsets the last complete push showed
    dtypes = report.dtypes  # as the engine reported after its last complete push
    tb, ta = engine_cast(tensors_of(b), dtypes), engine_cast(tensors_of(a), dtypes)
    v4 = mixed(tb, ta, 0.05, seed=4)
    unpatchable = set(tb) - set(dtypes)  # sent dense, as the trainer does
    delta = delta_checkpoint(tb, v4, "3", "4", tmp_path / "d4.safetensors", unpatchable)
    report = engine.push(delta)
    assert report.delta and report.changed
    cold_v4 = cold(model_dir_with(a, v4, tmp_path / "m4"))
    assert_parity(greedy(engine), cold_v4)

    # a delta diffed against bits the engine never held, mixing scattered writes with a norm
    # its loader writes whole (carried dense in another dtype: a cast): refused by the
    # fingerprints after writing started, every writer undone, the previous weights served
    norm = next(n for n in tb if n.endswith("norm.weight") and n in dtypes)
    other = torch.bfloat16 if dtypes[norm] == "float32" else torch.float32
    elsewhere = mixed(v4, tb, 0.5, seed=5)
    v5 = mixed(elsewhere, ta, 0.05, seed=6)
    elsewhere[norm], v5[norm] = elsewhere[norm].to(other), (v4[norm] * 1.5).to(other)
    refused = delta_checkpoint(
        elsewhere, v5, "4", "5", tmp_path / "d5.safetensors", unpatchable | {norm}
    )
    with pytest.raises(DirectReloadError, match="fingerprint"):
        engine.push(refused)
    assert str(engine.version) == "4" and engine.undefined is None
    assert_parity(greedy(engine), cold_v4)
    assert engine.addresses() == addresses


@pytest.mark.slow
def test_moe_push_in_the_default_multiprocess_engine(matrix_models, cold) -> None:
    """vLLM's default engine (workers in their own processes), MoE with the CPU prepack.

    Qwen3-MoE, not DeepSeek-V2: vLLM 0.32's CPU MLA is not deterministic in the multi-process
    engine (measured: two cold starts of the same checkpoint give different greedy tokens),
    so a cold start is no reference there; MLA + MoE is proven in-process above."""
    a, b = matrix_models["qwen3-moe"]
    r = run_engine_check("push", str(a), str(b), "--no-cold")
    assert_parity(r["b_pushed"], cold(b))  # the in-process family test's reference, cached
    assert_parity(r["a_pushed"], r["a_before"])
    assert_differs(r["b_pushed"], r["a_before"])
    assert r["addresses_unchanged"]
    assert any("cpu MoE prepack" in rep["refreshed"].values() for rep in r["reports"])
