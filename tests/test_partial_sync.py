"""Pushing only what changed from a real ``Trainer``: frozen layers, and PEFT LoRA adapters.

After every sync the engine must equal a cold start on the trainer's *full* weights as the
engine's model sees them (LoRA merged: PEFT's own ``merge_and_unload`` on a copy), although
only the first sync carried every tensor.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from helpers import (
    TinyLM,
    assert_differs,
    assert_parity,
    crash_before_rename,
    greedy,
    model_dir_saved_by_hf,
    trainer,
)
from lightning.pytorch.callbacks import Callback

from callbacks import CheckpointFiles, Schedule, VLLMWeightSync
from weight_bridge.checkpoint import BASE_VERSION_KEY, CheckpointReader
from weight_bridge.sync.changed import materialize, sync_state

FROZEN = ("model.embed_tokens.", "model.layers.0.")


class FullWeights(Callback):
    """Listed after the sync: at each push, the engine's outputs and the trainer's full weights
    as a model directory a cold start loads, saved by Hugging Face's own ``save_pretrained``
    (``merge``: PEFT's ``merge_and_unload`` on a deep copy first), not by the callback's code."""

    def __init__(
        self, sync: VLLMWeightSync, config_dir: Path, out: Path, merge: bool = False
    ) -> None:
        self.sync, self.config_dir, self.out, self.merge = sync, config_dir, out, merge
        self.pushes: list[dict] = []

    def _look(self, pl_module) -> None:
        if len(self.sync.history) == len(self.pushes):
            return
        model = pl_module.model
        if self.merge:
            model = copy.deepcopy(model).merge_and_unload()
        step = self.sync.history[-1]["step"]
        full = model_dir_saved_by_hf(self.config_dir, model, self.out / f"cold-{step}")
        assert self.sync.engine is not None
        self.pushes.append(
            {**self.sync.history[-1], "full": full, "greedy": greedy(self.sync.engine)}
        )

    def on_train_start(self, trainer, pl_module):
        self._look(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._look(pl_module)


def checkpoint_names(path: str) -> tuple[set[str], dict[str, str]]:
    with CheckpointReader(path) as reader:
        return set(reader.specs()), reader.metadata


def run_and_check(recorder: FullWeights, cold) -> None:
    """Every push equal to a cold start on the full weights it stood for."""
    references = cold.many([push["full"] for push in recorder.pushes])
    for i, (push, reference) in enumerate(zip(recorder.pushes, references, strict=True)):
        try:
            assert_parity(push["greedy"], reference)
        except AssertionError as exc:
            raise AssertionError(f"push {i} (step {push['step']}): {exc}") from None
        if i:
            assert_differs(push["greedy"], recorder.pushes[i - 1]["greedy"])  # training moved it


@pytest.mark.slow
def test_frozen_layers_are_never_pushed_after_the_first_sync(
    models, shared_engine, cold, tmp_path
) -> None:
    engine = shared_engine("llama_A")
    module = TinyLM(str(models["llama_A"]), lr=0.05)
    for name, p in module.model.named_parameters():
        p.requires_grad_(not name.startswith(FROZEN))
    sync = VLLMWeightSync(
        engine=engine,
        schedule=Schedule(every_n_train_steps=2, full_every_k=3),
        files=CheckpointFiles(keep_last_k=10),
    )
    recorder = FullWeights(sync, models["llama_A"], tmp_path)
    trainer(tmp_path, [sync, recorder], max_steps=6).fit(module)

    assert [(h["step"], h["partial"]) for h in sync.history] == [
        (0, False),
        (2, True),
        (4, True),
        (6, False),  # full_every_k=3: every third sync is complete
    ]
    full_names, _ = checkpoint_names(sync.history[0]["checkpoint"])
    names, meta = checkpoint_names(sync.history[1]["checkpoint"])
    assert meta[BASE_VERSION_KEY] == "0" and meta["version"] == "2"
    assert names == {n for n in full_names if not n.startswith(FROZEN)}
    assert sync.history[1]["bytes"] < sync.history[0]["bytes"]
    run_and_check(recorder, cold)


def test_a_failed_sync_makes_the_next_one_complete(
    models, shared_engine, tmp_path, monkeypatch
) -> None:
    engine = shared_engine("llama_A")
    crash_before_rename(monkeypatch, "step-00000002.safetensors")  # a mock: the save fails
    module = TinyLM(str(models["llama_A"]))
    module.model.model.embed_tokens.weight.requires_grad_(False)
    files = CheckpointFiles(dirpath=str(tmp_path / "ws"))
    sync = VLLMWeightSync(engine=engine, files=files, on_error="warn")
    with pytest.warns(UserWarning, match="save of step 2 failed"):
        trainer(tmp_path, [sync], max_steps=4).fit(module)
    assert [(h["step"], h["partial"]) for h in sync.history] == [
        (0, False),
        (1, True),
        (3, False),  # the first sync after the failed one
        (4, True),
    ]
    _, meta = checkpoint_names(sync.history[3]["checkpoint"])
    assert meta[BASE_VERSION_KEY] == "3"


@pytest.fixture
def lora_module(models):
    import peft  # a declared dependency (the dev and trainer extras): never skipped

    def make(targets: list[str]) -> TinyLM:
        module = TinyLM(str(models["qwen2_A"]), lr=0.5)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
        module.model = peft.get_peft_model(module.model, config)
        return module

    return make


@pytest.mark.slow
def test_lora_pushes_merged_adapted_weights_under_base_names(
    models, shared_engine, cold, lora_module, tmp_path
) -> None:
    """Qwen2: tied embeddings; q_proj and v_proj are slices of the engine's fused qkv_proj,
    gate_proj half of its fused gate_up_proj."""
    engine = shared_engine("qwen2_A")
    module = lora_module(["q_proj", "v_proj", "gate_proj"])
    sync = VLLMWeightSync(
        engine=engine,
        schedule=Schedule(every_n_train_steps=2),
        files=CheckpointFiles(keep_last_k=10),
    )
    recorder = FullWeights(sync, models["qwen2_A"], tmp_path, merge=True)
    trainer(tmp_path, [sync, recorder], max_steps=4).fit(module)

    assert [(h["step"], h["partial"]) for h in sync.history] == [(0, False), (2, True), (4, True)]
    full_names, _ = checkpoint_names(sync.history[0]["checkpoint"])
    assert not any(
        "lora_" in n or "base_layer" in n or n.startswith("base_model") for n in full_names
    )
    names, meta = checkpoint_names(sync.history[2]["checkpoint"])
    assert meta[BASE_VERSION_KEY] == "2"
    layers = module.model.base_model.model.config.num_hidden_layers
    assert names == {
        f"model.layers.{i}.{proj}.weight"
        for i in range(layers)
        for proj in ("self_attn.q_proj", "self_attn.v_proj", "mlp.gate_proj")
    }
    run_and_check(recorder, cold)


def test_lora_on_a_tied_embedding_is_refused_by_name(lora_module) -> None:
    module = lora_module(["embed_tokens"])
    with pytest.raises(ValueError, match=r"embed_tokens: a LoRA adapter on a tied weight"):
        sync_state(module.model, module.model.state_dict(), changing_only=True)


def test_sync_state_without_peft_keeps_names_and_drops_only_frozen(models) -> None:
    module = TinyLM(str(models["qwen2_A"]))
    module.model.model.embed_tokens.weight.requires_grad_(False)  # tied: lm_head too
    state = module.model.state_dict()
    everything = sync_state(module.model, state, changing_only=False)
    assert not everything.partial and set(everything) == set(state)
    changing = sync_state(module.model, state, changing_only=True)
    assert changing.partial
    assert set(state) - set(changing) == {"model.embed_tokens.weight", "lm_head.weight"}
    assert all(torch.equal(item.sources[0], state[k]) for k, item in changing.items())
    assert all(item.merge is None for item in changing.values())


def test_lora_merge_is_peft_merge(lora_module) -> None:
    """The merged weight the sync plans (base + PEFT's delta, from the adapter matrices it is
    handed) equals PEFT's own merge_and_unload, and only the adapted weights change."""
    module = lora_module(["q_proj", "gate_proj"])
    for name, p in module.model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero: give the delta something to show
            p.data.normal_(generator=torch.Generator().manual_seed(len(name)))
    state = sync_state(module.model, module.model.state_dict(), changing_only=True)
    merged = dict(materialize(state))
    want = copy.deepcopy(module.model).merge_and_unload().state_dict()
    assert set(merged) == {n for n in want if "q_proj.weight" in n or "gate_proj.weight" in n}
    for name, t in merged.items():
        torch.testing.assert_close(t, want[name], rtol=0, atol=1e-6)
        base = module.model.get_base_model().state_dict()[
            name.replace(".weight", ".base_layer.weight")
        ]
        assert (t - base).abs().max() > 1e-3, name  # the delta is really in it
