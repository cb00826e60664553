"""Deltas into a real vLLM engine: O(changed) writes through its fused, tied and MoE storages.

Each delta push is judged two ways: the engine's bits (the exact fingerprint of every tensor
it holds, read from live storage, against the trainer's tensors) and a cold start on the
equivalent full checkpoint (tokens and logprobs).

FAULT INJECTION (one case): a scattered write raises mid-delta, in the worker; a failure after
writing started cannot be caused otherwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import (
    assert_parity,
    delta_checkpoint,
    engine_cast,
    greedy,
    keyframe_checkpoint,
    mixed,
    model_dir_with,
    run_engine_check,
    tensors_of,
)

from weight_bridge.direct import DirectReloadError
from weight_bridge.direct.errors import BaseVersionError
from weight_bridge.exact import exact_fingerprint, format_fingerprint


def arm_delta_fault(worker) -> int:
    """FAULT INJECTION (sent with ``collective_rpc``): the second scattered write of the next
    delta raises. One shot."""
    import os

    import weight_bridge.direct.delta_writes as mod

    original = mod.scatter
    calls: list[int] = []

    def faulty(storage, where, values):
        calls.append(1)
        if len(calls) == 2:
            mod.scatter = original
            raise RuntimeError("injected fault in a delta's scattered write")
        original(storage, where, values)

    mod.scatter = faulty
    return os.getpid()


def assert_holds(engine, tensors: dict) -> None:
    """The engine holds exactly ``tensors``' bits (every tensor it holds whole)."""
    (held,) = engine.fingerprints()
    assert held, "the engine reported no fingerprint"
    for name, fp in held.items():
        assert fp == format_fingerprint(exact_fingerprint(tensors[name])), name


def undo_logs(worker) -> list[int]:
    """Sent with ``collective_rpc``: the bytes of each undo log the served chain holds, per
    link (0: none)."""
    served = worker.weight_transfer_engine.transaction.served
    return [link.undo.nbytes if link.undo is not None else 0 for link in served]


def push_chain(engine, a: Path, b: Path, tmp_path: Path, fractions: list[float]) -> list[dict]:
    """A complete push of ``a`` (version 1), then a delta per fraction towards ``b``; each
    checked bit for bit, the newest delta alone keeping its undo log (pre-images and their
    positions in 4 bytes: at most 3x what it wrote in bf16, 2x in fp32). Returns every
    version's tensors."""
    full = engine.push(a / "model.safetensors", version=1)
    assert full.dtypes and not full.delta
    versions = [engine_cast(tensors_of(a), full.dtypes)]
    target = engine_cast(tensors_of(b), full.dtypes)
    for k, fraction in enumerate(fractions, start=2):
        new = mixed(versions[-1], target, fraction, seed=k)
        path = delta_checkpoint(versions[-1], new, str(k - 1), str(k), tmp_path / f"d{k}")
        report = engine.push(path)
        assert report.delta and engine.version == str(k)
        changed = sum(int((new[n] != versions[-1][n]).sum()) for n in new)
        assert report.changed == changed
        *older, newest = engine.llm.collective_rpc(undo_logs)[0]
        assert older == [0] * len(older) and newest <= 3 * report.bytes, (older, newest)
        assert_holds(engine, new)
        versions.append(new)
    return versions


@pytest.mark.every_vllm
def test_deltas_equal_cold_starts_refuse_a_wrong_base_and_undo_a_fault(
    models, cold, engine_factory, tmp_path
) -> None:
    a, b = models["qwen2_A"], models["qwen2_B"]  # tied embeddings, fused qkv and gate_up
    engine = engine_factory(a)
    addresses = engine.addresses()
    versions = push_chain(engine, a, b, tmp_path, [0.03, 0.6])  # sparse, then dense tensors
    assert_parity(greedy(engine), cold(model_dir_with(a, versions[-1], tmp_path / "m3")))
    served = greedy(engine)

    stale = delta_checkpoint(versions[1], versions[0], "2", "4", tmp_path / "stale")
    with pytest.raises(BaseVersionError) as info:
        engine.push(stale)
    assert "version '2'" in str(info.value) and "version '3'" in str(info.value)

    # the base bits differ from what the delta was diffed against: fingerprints refuse it
    wrong = delta_checkpoint(versions[1], versions[0], "3", "5", tmp_path / "wrong")
    with pytest.raises(DirectReloadError, match="fingerprint") as info:
        engine.push(wrong)
    assert info.value.problems and "undo log restored" in str(info.value)
    assert engine.version == "3" and engine.undefined is None
    assert_holds(engine, versions[-1])

    engine.llm.collective_rpc(arm_delta_fault)
    nxt = mixed(versions[-1], versions[0], 0.05, seed=9)
    faulty = delta_checkpoint(versions[-1], nxt, "3", "6", tmp_path / "faulty")
    with pytest.raises(DirectReloadError, match="injected.*undo log restored"):
        engine.push(faulty)
    assert engine.version == "3" and engine.undefined is None
    assert_holds(engine, versions[-1])
    assert_parity(greedy(engine), served)
    engine.push(faulty)  # the same delta, no fault: applies
    assert_holds(engine, nxt)
    assert engine.addresses() == addresses

    engine.reload_mode = "layerwise"  # vLLM's reload: no write map, so no delta
    after = delta_checkpoint(nxt, versions[-1], "6", "7", tmp_path / "after")
    with pytest.raises(DirectReloadError, match="direct writer"):
        engine.push(after)
    assert engine.version == "6"


@pytest.mark.every_vllm
def test_a_delta_into_moe_experts_equals_a_cold_start(api_models, cold, engine_factory, tmp_path):
    _, families = api_models
    a, b = families["moe"]
    engine = engine_factory(a)
    versions = push_chain(engine, a, b, tmp_path, [0.04])
    assert_parity(greedy(engine), cold(model_dir_with(a, versions[-1], tmp_path / "m2")))


@pytest.mark.slow
def test_deltas_in_the_multiprocess_tensor_parallel_engine(models, tmp_path) -> None:
    """vLLM's multi-process engine, two tensor-parallel ranks: each rank writes the changed
    elements of its own shard (the vocabulary-sharded tied embedding, column and row parallel
    linears, fused qkv and gate_up); the engine core sums the ranks' parts of each sharded
    tensor's fingerprint. A delta equals a TP=2 cold start on the trainer's tensors; a delta
    diffed against other bits than those served fails that sum, is undone on both ranks, and
    the engine still serves the delta before it, every byte of it: that delta also carries
    ``model.norm.weight`` dense in bf16 (a cast: written whole through its loader, which keeps
    no pre-images), and the rollback re-writes it from the chain's files too."""
    a, b = models["qwen2_A"], models["qwen2_B"]
    fp32 = {n: "float32" for n in tensors_of(a)}
    ta, tb = engine_cast(tensors_of(a), fp32), engine_cast(tensors_of(b), fp32)
    v1 = mixed(ta, tb, 0.05, seed=1)
    # tensors split between the ranks (one KV head: k and v are replicated, as norms are)
    sharded = [n for n in ta if any(k in n for k in ("q_proj.w", "o_proj", "mlp.", "embed"))]
    elsewhere = {**v1, **{n: mixed(v1, ta, 0.5, seed=2)[n] for n in sharded}}  # never held
    v2 = mixed(elsewhere, tb, 0.05, seed=3)
    norm = "model.norm.weight"  # replicated; scaled (norms start at ones), in bf16: a loader's
    elsewhere[norm], v2[norm] = elsewhere[norm].bfloat16(), (tb[norm] * 1.5).bfloat16()
    # then, with readback="full", one element of rank 0's shard silently drifted where the
    # next delta changes nothing: the shards' parts of the full fingerprint, read back from
    # live storage, do not add up (at TP=1 the whole tensor is read back: the same refusal)
    drift = "model.layers.0.mlp.down_proj.weight"  # row parallel: split between the ranks
    v3 = mixed(v1, tb, 0.05, seed=5)
    files = [
        keyframe_checkpoint(ta, "0", tmp_path / "k0.safetensors"),
        delta_checkpoint(ta, v1, "0", "1", tmp_path / "d1.safetensors"),
        delta_checkpoint(elsewhere, v2, "1", "2", tmp_path / "d2.safetensors", dense={norm}),
        delta_checkpoint(v1, v3, "1", "3", tmp_path / "d3.safetensors"),
    ]
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # only so that the fault-injecting callable can be sent to the workers
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    }
    args = ("pushes", str(a), *map(str, files), "--tp", "2", "--drift", drift)
    r = run_engine_check(*args, env=env)
    keyframe, first, drifted, unread = r["steps"]
    assert unread["drifted"][0] is not None and unread["drifted"][1] is None
    assert set(unread["problems"]) == {drift}, unread
    assert "full tensor read back, summed over the ranks" in unread["problems"][drift]
    assert str(unread["version"]) == "1"
    assert keyframe["report"]["workers"] == 2
    assert first["report"]["delta"] and str(first["version"]) == "1"
    assert "fingerprint" in drifted["error"]["message"], drifted
    assert set(drifted["problems"]) <= set(sharded), drifted["problems"]
    assert all("summed over the ranks" in why for why in drifted["problems"].values())
    assert str(drifted["version"]) == "1"
    reference = run_engine_check(
        "cold", str(model_dir_with(a, v1, tmp_path / "m1")), "--tp", "2", env=env
    )
    assert_parity(first["greedy"], reference["cold"])
    assert_parity(drifted["greedy"], reference["cold"])
