"""A push into an engine that holds vLLM's online FP8 linears is re-quantized in place, and is
exactly a cold start of the same quantized engine on the pushed weights.

vLLM quantizes each such linear once, at load: its ``weight`` becomes FP8 bytes (stored
transposed) with a ``weight_scale`` computed from the whole fused float tensor. A float written
into those bytes serves garbage (before issue 65 a partial push of a square ``o_proj`` alone
passed every check and generated one token over and over), so the bridge runs the layer's own
quantization again on the new floats and copies bytes and scale into the live storages. What
is proven here, against a real engine on each vLLM (``fp8_per_channel`` on both; ``fp8``, one
scale per fused tensor, where the kernel exists: 0.34):

* a complete push, then a partial push carrying whole fused groups, leave every FP8 byte and
  scale bit for bit those of a cold start on the same weights, greedy tokens and logprobs
  exactly equal, the storages where they were (what CUDA graphs captured);
* a partial push splitting a fused group (the scale needs every shard), NaN in a shard even
  with ``check_finite`` off, a delta, tensors pushed from memory (not re-quantized yet) and a
  layer whose load-time proof failed (its bytes and scale not reproduced by quantizing its
  floats again: here every layer's holds, so one is marked as failed) are refused by name,
  with nothing written;
* a failure inside the write (restored from the writer's pre-images), and one after it (the
  checkpoint served before written again; a partial push's pre-images restored), leave the
  bytes and scales bit for bit as before, and the engine serves as before under its label.

The engine quantized per channel is shared by the tests in file order; each cold start, the
reference, is an engine of its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import (
    ENGINE_KWARGS,
    arm_cache_fault,
    arm_write_fault,
    close_engine,
    for_model,
    greedy,
    model_dir_with,
    open_engine,
    partial_checkpoint,
    tensors_of,
)

from weight_bridge import DirectReloadError, WeightBridgeError, save_checkpoint
from weight_bridge.checkpoint.format import BASE_VERSION_KEY
from weight_bridge.checkpoint.live import LiveCheckpoint
from weight_bridge.delta.format import DELTA_KEY
from weight_bridge.testing.models import build_tiny_model, perturb_checkpoint
from weight_bridge.vllm.internals.versions import vllm_minor

pytestmark = [pytest.mark.slow, pytest.mark.every_vllm]

QKV = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
GATE_UP = [f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up")]
METHODS = [
    "fp8_per_channel",
    pytest.param(
        "fp8",
        marks=pytest.mark.skipif(
            vllm_minor() < (0, 34), reason="vLLM 0.32's CPU build lacks the per-tensor kernel"
        ),
    ),
]


def fp8_state(worker) -> dict:
    """Sent to the worker: every FP8 linear's bytes, scale bits and storage addresses."""
    model = worker.model_runner.get_model()
    out = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dtype == torch.float8_e4m3fn:
            scale = module.weight_scale.detach()
            out[name] = (
                weight.detach().view(torch.uint8).contiguous().numpy().tobytes(),
                scale.view(torch.int32).contiguous().numpy().tobytes(),
                weight.data_ptr(),
                scale.data_ptr(),
            )
    return out


def state(engine) -> dict:
    return engine.llm.collective_rpc(fp8_state)[0]


def engine_on(model: Path, quantization: str):
    return open_engine(
        model, key=("fp8", quantization), dtype="bfloat16", quantization=quantization
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("fp8")
    a = build_tiny_model(tmp / "a", arch="llama", seed=0)
    return {
        "a": a,
        "b": perturb_checkpoint(a, tmp / "b", scale=0.5, seed=1),
        "c": perturb_checkpoint(a, tmp / "c", scale=0.5, seed=2),
        "tmp": tmp,
    }


def proofs(worker, unprove: str | None = None) -> dict:
    """Sent to the worker: each FP8 linear's load-time proof (None: its bytes and scale were
    reproduced bit for bit); ``unprove`` marks one unproven, as a failed proof would."""
    from weight_bridge.vllm.worker.fp8_requant import _layers

    model = worker.model_runner.get_model()
    found = {name: _layers.get(m) for name, m in model.named_modules()}
    if unprove is not None:
        found[unprove].unproven = "unproven in a test"
    return {name: r.unproven for name, r in found.items() if r is not None}


def reset_proofs(worker) -> None:
    from weight_bridge.vllm.worker.fp8_requant import _layers

    for record in _layers.values():
        record.unproven = None


def _refused(engine, checkpoint: Path, match: str, **push) -> dict:
    before, served = state(engine), greedy(engine)
    with pytest.raises(DirectReloadError, match=match) as refused:
        engine.push(checkpoint, **push)
    assert "nothing was written" in str(refused.value)
    assert state(engine) == before and greedy(engine) == served
    return refused.value.problems


def test_a_split_group_nan_or_delta_is_refused_by_name(models: dict) -> None:
    a, b, tmp = models["a"], models["b"], models["tmp"]
    engine = engine_on(a, "fp8_per_channel")
    served = engine.version or "default"  # the weights it started with
    split = partial_checkpoint(b, QKV[:2], served, "S", tmp / "split.safetensors")
    problems = _refused(engine, split, "splits a quantized module", version="S")
    assert "v_proj.weight" in problems["model.layers.0.self_attn.qkv_proj"]
    tensors = {n: tensors_of(b)[n].clone() for n in QKV}
    tensors[QKV[1]][3, 5] = float("nan")
    nan = tmp / "nan.safetensors"
    save_checkpoint(tensors, nan, {BASE_VERSION_KEY: served})
    problems = _refused(engine, nan, "not be finite", version="N", check_finite=False)
    assert "NaN" in problems[QKV[1]]
    meta = {BASE_VERSION_KEY: served, DELTA_KEY: "1"}
    delta = tmp / "delta.safetensors"
    save_checkpoint({QKV[0]: tensors_of(b)[QKV[0]]}, delta, meta)
    _refused(engine, delta, "delta is never applied to quantized bytes", version="D")
    live = LiveCheckpoint.of(tensors_of(b), {"version": "L"})
    _refused(engine, live, "pushed from memory are not re-quantized")
    proven = engine.llm.collective_rpc(proofs)[0]
    assert proven.keys() == set(state(engine)) and not any(proven.values())
    down = "model.layers.1.mlp.down_proj"
    engine.llm.collective_rpc(proofs, args=(down,))
    try:
        problems = _refused(engine, b, "cannot re-quantize", version="U")
        assert problems.keys() == {down} and "unproven in a test" in problems[down]
    finally:
        engine.llm.collective_rpc(reset_proofs)


def test_a_failure_in_or_after_the_write_restores_bytes_and_scales(models: dict) -> None:
    a, b, tmp = models["a"], models["b"], models["tmp"]
    engine = engine_on(a, "fp8_per_channel")
    before, served, label = state(engine), greedy(engine), engine.version
    engine.llm.collective_rpc(arm_write_fault)  # down_proj of layer 1: mid-way through
    with pytest.raises(WeightBridgeError):
        engine.push(b, version="F1")
    assert state(engine) == before and greedy(engine) == served
    arm_cache_fault(engine)  # the step after every write
    with pytest.raises(WeightBridgeError):
        engine.push(b, version="F2")
    assert state(engine) == before and greedy(engine) == served and engine.version == label
    groups = partial_checkpoint(b, QKV, label or "default", "F3", tmp / "groups.safetensors")
    arm_cache_fault(engine)  # a partial push of quantized modules only: undone from pre-images
    with pytest.raises(WeightBridgeError):
        engine.push(groups, version="F3")
    assert state(engine) == before and greedy(engine) == served and engine.version == label


@pytest.mark.parametrize("quantization", METHODS)
def test_pushes_equal_a_cold_start_of_the_quantized_engine(models: dict, quantization: str) -> None:
    from weight_bridge import ColocatedEngine

    a, b, c, tmp = models["a"], models["b"], models["c"], models["tmp"] / quantization
    engine = engine_on(a, quantization)
    before = state(engine)
    assert before, "the engine holds no FP8 linear"
    # no dtypes a delta could patch: a trainer's delta="auto" sends this engine full syncs
    assert engine.push(b, version="B").dtypes == {}
    whole_groups = [*QKV, *GATE_UP, "model.layers.1.self_attn.o_proj.weight"]
    part = partial_checkpoint(c, whole_groups, "B", "C", tmp.with_suffix(".safetensors"))
    assert engine.push(part, version="C").partial
    pushed, got = state(engine), greedy(engine)
    close_engine()
    want_tensors = {**tensors_of(b), **{n: tensors_of(c)[n] for n in whole_groups}}
    cold_dir = model_dir_with(a, want_tensors, tmp)
    kwargs = {**ENGINE_KWARGS, "dtype": "bfloat16", "quantization": quantization}
    with ColocatedEngine(cold_dir, **for_model(cold_dir, kwargs)) as cold:
        want_state, want = state(cold), greedy(cold)
    assert pushed.keys() == want_state.keys() == before.keys()
    for name, (q, scale, q_ptr, scale_ptr) in pushed.items():
        assert q == want_state[name][0], f"{name}: FP8 bytes differ from a cold start"
        assert scale == want_state[name][1], f"{name}: scale differs from a cold start"
        assert (q_ptr, scale_ptr) == before[name][2:], f"{name}: a storage moved"
    assert got == want  # tokens and logprobs exactly, not within a tolerance
