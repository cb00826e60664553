"""Relocation inside a real vLLM engine: a stock architecture whose post-load processing moves
weights into a fused buffer, a row-padded buffer and a column-major copy (issue 10)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import assert_parity, greedy, run_engine_check
from safetensors.torch import load_file

import weight_bridge.direct.plan as plan_mod
from weight_bridge.checkpoint import BASE_VERSION_KEY, CheckpointReader, save_checkpoint
from weight_bridge.direct import DirectReloadError
from weight_bridge.direct.resolve import ResolvedTarget
from weight_bridge.testing import TEST_ARCHITECTURES
from weight_bridge.testing.architectures import (
    ARCHITECTURE,
    DERIVED_MODULE,
    PROCESSING_ARCHITECTURE,
    TRANSFORMED_MODULE,
)
from weight_bridge.testing.models import build_tiny_model, perturb_checkpoint


@pytest.fixture(scope="module")
def relocating(tmp_path_factory):
    root = tmp_path_factory.mktemp("relocating")
    a = build_tiny_model(root / "A", arch="llama", seed=3, architecture_name=ARCHITECTURE)
    return a, perturb_checkpoint(a, root / "B", scale=0.3, seed=4)


def fused_weights_match(worker, path: str) -> list[str]:
    """Worker-side: names whose live weight differs from the checkpoint (empty = all intact)."""
    ckpt = load_file(path)
    model = worker.model_runner.get_model()
    bad = []
    for name, module in model.named_modules():
        if name.endswith("o_proj") or name.endswith("down_proj"):
            want = ckpt[f"{name}.weight"]
            if not torch.equal(module.weight.detach(), want):
                bad.append(name)
    return bad


def forget_plan(worker) -> None:
    """The worker's cached plan dropped, so the next push resolves every weight again (with
    whatever resolver is installed now)."""
    from weight_bridge.direct.state import bridge_state

    bridge_state(worker.model_runner.get_model()).plan_cache = None


def offset_only_resolver(entry, live):  # the bug of vLLM PR 65281, reproduced on purpose
    view = torch.as_strided(live.detach(), entry.shape, entry.stride, entry.storage_offset)
    return ResolvedTarget(entry.name, view)


@pytest.mark.parametrize("resolver", ["current offset", "offset only"])
def test_push_into_relocated_engine_matches_cold_start(
    resolver, relocating, cold, engine_factory, monkeypatch
) -> None:
    a, b = relocating
    engine = engine_factory(a)
    addresses = engine.addresses()
    plan = engine.plan()[0]
    assert not plan["problems"]
    moved = {n for n, t in plan["targets"].items() if t["relocation"]}
    assert any("o_proj" in n for n in moved) and any("gate_up_proj" in n for n in moved)
    assert any("down_proj" in n for n in moved)

    if resolver == "offset only":
        # A deliberately wrong resolver (the bug of vLLM PR 65281) at push time, overlap guard
        # off: its targets are not the views proven at load, so nothing is written.
        monkeypatch.setattr(plan_mod, "resolve_target", offset_only_resolver)
        monkeypatch.setattr(plan_mod, "overlapping_targets", lambda targets, aliases: {})
        engine.llm.collective_rpc(forget_plan)  # the plan above was cached with the right one
        with pytest.raises(DirectReloadError, match="not the view proven") as info:
            engine.push(b, version=1)
        assert any("o_proj" in n for n in info.value.names)
        assert engine.undefined is None
        assert_parity(greedy(engine), cold(a))
        return

    report = engine.push(b, version=1)
    assert {r.name for r in report.relocations} == moved
    assert_parity(greedy(engine), cold(b))
    bad = engine.llm.collective_rpc(fused_weights_match, args=(str(b / "model.safetensors"),))
    assert bad == [[]]  # every weight in the fused / padded buffers holds B: neighbours intact
    assert engine.addresses() == addresses

    engine.push(a, version=2)
    assert_parity(greedy(engine), cold(a))
    assert engine.addresses() == addresses


@pytest.mark.slow
def test_multiprocess_engine_with_relocations(relocating) -> None:
    a, b = relocating
    r = run_engine_check("push", str(a), str(b))
    assert_parity(r["b_pushed"], r["b_cold"])
    assert_parity(r["a_pushed"], r["a_before"])
    assert r["addresses_unchanged"]
    assert r["reports"][0]["relocations"]


def test_explain_prints_every_weight(relocating, tmp_path) -> None:
    a, _ = relocating
    out = subprocess.run(
        [sys.executable, "-m", "weight_bridge.explain", str(a), "--plugin", TEST_ARCHITECTURES]
        + ["--dtype", "float32"],  # "auto" is bfloat16 where the CPU has it: no packing there
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "model.layers.0.self_attn.o_proj.weight" in text
    assert "moved, resolved" in text and "direct (in place)" in text
    assert "0 not directly reloadable" in text and "refresh cpu packed linear" in text

    stock = subprocess.run(
        [
            sys.executable,
            "-m",
            "weight_bridge.explain",
            str(a),
            "--cpu-linear",
            "stock",
            "--dtype",
            "float32",
            "--plugin",
            TEST_ARCHITECTURES,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert stock.returncode == 0, stock.stderr[-3000:]
    assert "NOT directly reloadable: storage emptied" in stock.stdout


@pytest.fixture(scope="module")
def processing(tmp_path_factory):
    root = tmp_path_factory.mktemp("processing")
    a = build_tiny_model(
        root / "A", arch="llama", seed=5, architecture_name=PROCESSING_ARCHITECTURE
    )
    return a, perturb_checkpoint(a, root / "B", scale=0.3, seed=6)


def test_transformed_and_derived_weights_refused_in_direct_reprocessed_in_auto(
    processing, cold, engine_factory
) -> None:
    """One engine: ``direct`` refuses the two modules by name with nothing written; ``auto``
    writes everything else directly (relocations included) and re-processes only those two."""
    a, b = processing
    engine = engine_factory(a)
    addresses = engine.addresses()
    before = greedy(engine)
    assert_parity(before, cold(a))
    with pytest.raises(DirectReloadError) as info:
        engine.push(b, version=1)
    problems = info.value.problems
    assert "transformed" in problems[f"{TRANSFORMED_MODULE}.weight"]
    assert "weight_t" in problems[f"{DERIVED_MODULE}.weight"]
    assert engine.undefined is None and engine.version is None
    assert_parity(greedy(engine), before)

    engine.reload_mode = "auto"
    report = engine.push(b, version=2)
    assert report.mode == "auto"
    assert set(report.reprocessed) == {TRANSFORMED_MODULE, DERIVED_MODULE}
    assert report.relocations and report.direct > 0 and report.verified_writes > 0
    assert_parity(greedy(engine), cold(b))
    assert engine.addresses() == addresses
    engine.push(a, version=3)
    assert_parity(greedy(engine), before)
    assert engine.addresses() == addresses

    # A partial checkpoint cannot feed vLLM's re-processing, which loads whole modules.
    name = "model.layers.1.mlp.down_proj.weight"  # untouched by the processing
    partial = save_partial(b, name, base="3", path=a.parent / "partial.safetensors")
    with pytest.raises(DirectReloadError, match="cannot be re-processed") as info:
        engine.push(partial)
    assert set(info.value.problems) == {TRANSFORMED_MODULE, DERIVED_MODULE}
    assert engine.version == 3 and engine.undefined is None
    assert_parity(greedy(engine), before)


def save_partial(model_dir, name: str, base: str, path) -> str:
    with CheckpointReader(model_dir / "model.safetensors") as reader:
        tensor = reader.tensor(name).clone()
    save_checkpoint({name: tensor}, path, {BASE_VERSION_KEY: base, "version": "partial"})
    return str(path)


def test_explain_names_refreshed_and_reprocessed_modules(processing) -> None:
    a, _ = processing
    out = subprocess.run(
        [sys.executable, "-m", "weight_bridge.explain", str(a), "--mode", "auto"]
        + ["--plugin", TEST_ARCHITECTURES],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert f"{TRANSFORMED_MODULE}.*" in text and f"{DERIVED_MODULE}.*" in text
    assert "re-processed by vLLM layerwise: weight values changed" in text
    assert "weight_t" in text and "moved, resolved" in text and "refresh cpu packed linear" in text
    assert "2 modules re-processed, 0 not directly reloadable" in text
    assert "noted, not blocking (no weight there):" in text and "_k_scale_cpu" in text
