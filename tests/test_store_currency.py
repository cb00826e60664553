"""The host store a push from memory rolls back to is current only where the engine holds what
it copied, whichever writer ran in between (issue 62, hazard 1), in a real in-process engine.

Each case: push B from memory (the store is filled, then caught up), push C with one writer
(a file in each reload mode, a partial, a delta with and without its loader, a push from
memory, a file push that failed and rolled back), then a push D from memory whose write fails
mid-way. The engine must end bit for bit on what it served after C (every parameter's bytes),
under C's label, defined: never B's bits under C's label, which is what a store told about
writes (and not told about this one) restored before. The reference is the engine's own state
right after C, which the same checks show equal to a cold start elsewhere."""

from __future__ import annotations

import pytest
from helpers import (
    FAULT_PARAM,
    arm_write_fault,
    assert_parity,
    delta_checkpoint,
    greedy,
    keyframe_checkpoint,
    mixed,
    open_engine,
    partial_checkpoint,
    tensors_of,
    weights_digest,
)

from weight_bridge.checkpoint.live import LiveCheckpoint
from weight_bridge.direct import DirectReloadError
from weight_bridge.vllm.internals.vllm_direct import vllm_direct_missing

pytestmark = pytest.mark.every_vllm

WRITERS = ["direct", "layerwise", "vllm-direct", "partial", "delta", "delta+loader", "memory"]
WRITERS += ["rolled-back"]


def _push_c(engine, writer: str, ta: dict, tb: dict, tmp) -> None:
    """C with ``writer``, on top of B (served from memory)."""
    names = sorted(n for n in ta if n.endswith("self_attn.o_proj.weight"))
    target = mixed(tb, ta, 0.05, seed=3)
    if writer in ("direct", "layerwise", "vllm-direct", "rolled-back"):
        engine.reload_mode = "direct" if writer == "rolled-back" else writer
        c = keyframe_checkpoint(ta, "C", tmp / "C.safetensors")
        if writer == "rolled-back":  # a file push that fails, then the push that lands
            engine.llm.collective_rpc(arm_write_fault)
            with pytest.raises(DirectReloadError, match="rolled back"):
                engine.push(c, version="X")
        engine.push(c, version="C")
    elif writer == "partial":
        engine.push(partial_checkpoint(tmp / "A", names, "B", "C", tmp / "C.safetensors"))
    elif writer.startswith("delta"):
        dense = set(names) if writer == "delta+loader" else None
        engine.push(delta_checkpoint(tb, target, "B", "C", tmp / "C.safetensors", dense=dense))
    else:
        engine.push(LiveCheckpoint.of(ta), version="C")
    engine.reload_mode = "direct"


@pytest.mark.parametrize("writer", WRITERS)
def test_a_failed_push_from_memory_restores_what_any_writer_left(models, tmp_path, writer):
    if writer == "vllm-direct" and vllm_direct_missing() is not None:
        pytest.skip(str(vllm_direct_missing()))
    a = models["llama_A"]
    (tmp_path / "A").symlink_to(a)
    engine = open_engine(a, key="store-currency")
    ta, tb = tensors_of(a), tensors_of(models["llama_B"])
    engine.reload_mode = "direct"
    engine.push(a / "model.safetensors", version="A")  # every case starts from A, a file
    # the store is filled with A, then caught up with B
    engine.push(LiveCheckpoint.of(tb), version="B")
    _push_c(engine, writer, ta, tb, tmp_path)
    assert engine.version == "C" and engine.undefined is None
    served_c, digest_c = greedy(engine), engine.llm.collective_rpc(weights_digest)

    engine.llm.collective_rpc(arm_write_fault)
    d = {n: t * 1.5 for n, t in tb.items()}
    assert FAULT_PARAM in d
    with pytest.raises(DirectReloadError, match="version 'C'"):
        engine.push(LiveCheckpoint.of(d), version="D")
    assert engine.version == "C" and engine.undefined is None
    assert engine.llm.collective_rpc(weights_digest) == digest_c, "not C's bits under C's label"
    assert_parity(greedy(engine), served_c)
