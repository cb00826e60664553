"""A push into an engine that holds quantized weights (vLLM's online FP8) is refused by name.

vLLM quantizes each such linear once, at load: its ``weight`` becomes FP8 bytes (stored
transposed) with a ``weight_scale`` derived from the float weights. No writer of the bridge
re-quantizes yet (issue 65), and a float written into those bytes serves garbage: before this
refusal, a partial push of a square ``o_proj`` alone passed every check and the engine
generated one token over and over, where a cold start on the same weights does not; a complete
push failed mid-write on a bare ``AssertionError`` and left the engine undefined. Now both are
refused before anything is written, naming the quantized layers, and the engine serves as
before under its version. ``fp8_per_channel`` runs on both vLLMs on this CPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import close_engine, greedy, open_engine, partial_checkpoint, tensors_of

from weight_bridge import DirectReloadError
from weight_bridge.testing.models import build_tiny_model, perturb_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.every_vllm]


def test_a_push_into_quantized_layers_is_refused_by_name_and_writes_nothing(
    tmp_path: Path,
) -> None:
    a = build_tiny_model(tmp_path / "a", arch="llama", seed=0)
    b = perturb_checkpoint(a, tmp_path / "b", scale=0.5, seed=1)
    engine = open_engine(a, key="fp8", dtype="bfloat16", quantization="fp8_per_channel")
    try:
        before = greedy(engine)
        o_proj = [n for n in tensors_of(a) if "o_proj" in n]
        part = partial_checkpoint(b, o_proj, "default", "B-o", tmp_path / "o.safetensors")
        for checkpoint in (part, b):  # the partial one passed every check before
            with pytest.raises(DirectReloadError, match="quantized") as refused:
                engine.push(checkpoint, version="B")
            assert "model.layers.0.self_attn.o_proj" in refused.value.problems
            assert "nothing was written" in str(refused.value)
            assert greedy(engine) == before  # served, not undefined, the same weights
    finally:
        close_engine()
