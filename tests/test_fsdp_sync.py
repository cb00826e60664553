"""``VLLMWeightSync`` under FSDP2: a real ``Trainer`` with Lightning's ``ModelParallelStrategy``,
two gloo processes on CPU, ``fully_shard`` in ``configure_model``, one engine per rank
(``tests/fsdp_sync_check.py``).

Every rank takes part in each gather, rank 0 streams each gathered tensor into the checkpoint,
and each rank pushes its own engine. After every sync each rank's engine must equal a cold start
on the trainer's *full* weights (gathered by torch's own ``get_model_state_dict``, LoRA merged by
PEFT), and a sync that fails on one rank mid-gather must fail on every rank within
``PROMPT_S``, leave no file behind, and leave every engine serving the version before.

One subprocess run per model covers several checks (each engine costs seconds and ~1.5 GiB).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TESTS, assert_differs, assert_parity

from weight_bridge.checkpoint import BASE_VERSION_KEY, CheckpointReader

pytestmark = pytest.mark.slow

PROMPT_S = 30.0  # a failing sync ends on every rank within this (one tensor's work, measured <1 s)
RUN_TIMEOUT_S = 600  # a hang fails the test instead of the run


def run_fsdp(model: Path, out: Path, *args: str) -> list[dict]:
    """Run the two-rank job; each rank's report."""
    out.mkdir()
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(TESTS / "fsdp_sync_check.py"), str(model), str(out), *args],
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    print(f"fsdp run {args} took {time.monotonic() - started:.0f} s")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def file_of(path: str) -> tuple[set[str], dict[str, str]]:
    with CheckpointReader(path) as reader:
        reader.verify_hash()
        return set(reader.specs()), reader.metadata


def check_pushes(ranks: list[dict], out: Path, cold) -> None:
    """Both ranks saw the same pushes, each equal to a cold start on the full weights (the
    model directories rank 0 saved with Hugging Face's ``save_pretrained``)."""
    steps = [p["step"] for p in ranks[0]["pushes"]]
    assert [p["step"] for p in ranks[1]["pushes"]] == steps
    references = cold.many([out / f"ref-{step}" for step in steps])
    for i, (step, reference) in enumerate(zip(steps, references, strict=True)):
        for rank in ranks:
            push = rank["pushes"][i]
            assert push["version"] == step
            try:
                assert_parity(push["greedy"], reference)
            except AssertionError as exc:
                raise AssertionError(f"rank {rank['rank']}, step {step}: {exc}") from None
        if i:
            assert_differs(ranks[0]["pushes"][i]["greedy"], ranks[0]["pushes"][i - 1]["greedy"])


def check_failure(ranks: list[dict], failed_step: int, words: str) -> None:
    """Every rank raised promptly; every engine serves the last good push; no file left."""
    fault_at = min(r["fault"]["fault_at"] for r in ranks if "fault_at" in r["fault"])
    last = ranks[0]["pushes"][-1]
    for rank in ranks:
        report = rank["fault"]
        assert "error" in report, f"rank {rank['rank']} did not raise"
        assert report["raised_at"] - fault_at < PROMPT_S, report
        assert report["version"] == last["step"]
        assert_parity(report["greedy"], rank["pushes"][-1]["greedy"])
        assert f"step-{failed_step:08d}.safetensors" not in report["files"]
        assert not [f for f in report["files"] if f.endswith(".tmp")], report["files"]
    errors = [r["fault"]["error"] for r in ranks]
    assert any(words in e for e in errors), errors
    assert any(f"weight sync of step {failed_step} failed on another rank" in e for e in errors)


def test_fsdp2_frozen_layers_llama(models, cold, tmp_path) -> None:
    """Untied Llama, embeddings and layer 0 frozen: a complete sync, then partial ones; then a
    fault on rank 1 (the non-writer) between two gathers of the sync of step 6 (a mock)."""
    out = tmp_path / "run"
    ranks = run_fsdp(models["llama_A"], out, "--mode", "frozen", "--steps", "6",
                     "--fault", "gather", "--fault-step", "6")  # fmt: skip
    pushes = ranks[0]["pushes"]
    assert [(p["step"], p["partial"]) for p in pushes] == [(0, False), (2, True), (4, True)]
    complete, _ = file_of(pushes[0]["checkpoint"])
    names, meta = file_of(pushes[1]["checkpoint"])
    assert meta[BASE_VERSION_KEY] == "0" and meta["version"] == "2"
    frozen = ("model.embed_tokens.", "model.layers.0.")
    assert names == {n for n in complete if not n.startswith(frozen)}
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= complete
    check_pushes(ranks, out, cold)
    check_failure(ranks, 6, "injected fault on rank 1 mid-gather")


def test_fsdp2_lora_tied_qwen2(models, cold, tmp_path) -> None:
    """Tied Qwen2 with PEFT LoRA on q_proj/v_proj/gate_proj (slices of the engine's fused
    qkv_proj and gate_up_proj): the delta computed on gathered matrices, merged weights under the
    base names, the tied embedding written once; then the writer's disk refuses the sync of
    step 4 mid-stream (RLIMIT_FSIZE, real)."""
    out = tmp_path / "run"
    ranks = run_fsdp(models["qwen2_A"], out, "--mode", "lora", "--steps", "4",
                     "--fault", "disk", "--fault-step", "4")  # fmt: skip
    pushes = ranks[0]["pushes"]
    assert [(p["step"], p["partial"]) for p in pushes] == [(0, False), (2, True)]
    complete, _ = file_of(pushes[0]["checkpoint"])
    assert "model.embed_tokens.weight" in complete and "lm_head.weight" not in complete
    assert not any(
        "lora_" in n or "base_layer" in n or n.startswith("base_model") for n in complete
    )
    names, meta = file_of(pushes[1]["checkpoint"])
    assert meta[BASE_VERSION_KEY] == "0"
    assert names == {
        f"model.layers.{i}.{proj}.weight"
        for i in range(2)
        for proj in ("self_attn.q_proj", "self_attn.v_proj", "mlp.gate_proj")
    }
    check_pushes(ranks, out, cold)
    check_failure(ranks, 4, "File too large")
