"""A PEFT LoRA policy trained by a real ``Trainer`` syncs its adapter, and the engine then serves
exactly what a cold start on that adapter serves.

The callback starts the engine itself from an ``EngineSpec`` on the base (LoRA enabled by the
callback: rank and slots from the PEFT config). After every sync the engine's newest slot is
fingerprinted and sampled (greedy tokens, logprobs) through an explicit ``LoRARequest``, and the
trainer's adapter is saved with PEFT's own ``save_pretrained``. The reference is a cold start: a
fresh engine with LoRA on the same base and a ``LoRARequest`` on each saved directory. A sync's
bytes are the adapter's. What an adapter push cannot serve (a rank above vLLM's largest; the
refusals of the live model and its config) pushes merged weights, the reason in the record.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import close_engine, lora_greedy, open_engine, trainer
from safetensors.torch import load_file

from callbacks import EngineSpec, VLLMWeightSync
from callbacks.engine import adapter_sync
from weight_bridge.checkpoint.adapter import ADAPTER_WEIGHTS
from weight_bridge.sync import CheckpointFiles
from weight_bridge.sync.adapter import adapter_plan
from weight_bridge.testing.adapters import ATTENTION, MLP
from weight_bridge.testing.models import build_tiny_model

ARGS = dict(dtype="float32", max_model_len=128, seed=0, max_num_seqs=8, enforce_eager=True)
PROMPTS = [[1, 20, 21], [1, 30, 31, 32], [1, 7]]


def lora_policy(base: Path, seed: int = 1, **config):
    """A PEFT LoRA model on ``base``, A and B seeded at random (PEFT's B = 0 would make every
    version the base and every comparison vacuous)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = {"r": 8, "lora_alpha": 24, "target_modules": list(ATTENTION + MLP), **config}
    peft = get_peft_model(model, LoraConfig(lora_dropout=0.0, **config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    return peft


def policy_module(model):
    import lightning.pytorch as pl

    class Policy(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            ids = torch.tensor([[1, 20, 21, 22, 23, 24, 25, 26]])
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self):
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=2.0)

    return Policy()


def sample(engine, lora_request) -> list[tuple[list[int], list[float]]]:
    return lora_greedy(engine, [{"prompt_token_ids": p} for p in PROMPTS], lora_request)


def slots(engine) -> dict:
    (answer,) = engine._rpc("adapters")  # one worker
    return answer


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("adapter-sync") / "llama", seed=0)


def test_plan_says_what_an_adapter_push_cannot_serve(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each policy the engine's slots cannot hold syncs merged, its reason by name; a plain
    one pushes its adapter, and the engine the callback starts gets the slots it needs."""
    from peft import LoraConfig

    plain = adapter_plan(lora_policy(base))
    assert plain is not None and plain.pushes and plain.rank == 8
    assert plain.engine_args() == {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}
    wide = adapter_plan(lora_policy(base, r=9, rank_pattern={"q_proj": 33}))
    assert wide is not None and wide.engine_args()["max_lora_rank"] == 64
    cases = {
        "DoRA": {"use_dora": True},
        "modules_to_save": {"modules_to_save": ["lm_head"]},
        "biases": {"bias": "lora_only"},
        "exceeds vLLM's largest": {"r": 520},
        "embed_tokens (Embedding)": {"target_modules": ["embed_tokens", "q_proj"]},
        "LoRA on lm_head": {"target_modules": ["lm_head", "q_proj"]},
    }
    for why, config in cases.items():
        plan = adapter_plan(lora_policy(base, **config))
        assert plan is not None and not plan.pushes and why in plan.describe()["why"], plan
    two = lora_policy(base)
    two.add_adapter("other", LoraConfig(r=8, target_modules=["q_proj"]))
    two.base_model.set_adapter(["default", "other"])
    plan = adapter_plan(two)
    assert plan is not None and "2 active adapters" in str(plan.why)
    trained = lora_policy(base)
    trained.base_model.model.model.norm.weight.requires_grad_(True)
    plan = adapter_plan(trained)
    assert plan is not None and "model.norm.weight is trained too" in str(plan.why)
    assert adapter_plan(torch.nn.Linear(2, 2)) is None  # no PEFT model: merged, no record
    # the engine the callback starts gets the slots, each unless the user set it
    started: dict = {}
    monkeypatch.setattr("callbacks.engine.start_engine", lambda _m, _mode, **a: started.update(a))
    mine = EngineSpec(model=str(base), options={"engine_args": {"max_loras": 4}})
    mine.start(base, 1, plain.engine_args())
    assert (started["enable_lora"], started["max_lora_rank"], started["max_loras"]) == (True, 8, 4)
    # the engine decides too: one given without LoRA slots, a server, several ranks
    assert "no LoRA slots" in str(adapter_sync(None, object(), lora_policy(base), 1).why)
    served = EngineSpec(url="http://localhost:1")
    assert "at a url" in str(adapter_sync(served, None, lora_policy(base), 1).why)
    spec = EngineSpec(model=str(base), options={"engine_args": {"enable_lora": False}})
    assert "enable_lora=False" in str(adapter_sync(spec, None, lora_policy(base), 1).why)
    assert "2 ranks" in str(
        adapter_sync(EngineSpec(model=str(base)), None, lora_policy(base), 2).why
    )


class Snapshot:
    """After each sync of ``sync`` (a callback after it): the engine's newest slot and what it
    samples, and the trainer's adapter saved by PEFT (the cold start's reference)."""

    def __init__(self, sync: VLLMWeightSync, out: Path) -> None:
        self.sync, self.out = sync, out
        self.seen: dict[int, dict] = {}

    def take(self, trainer, pl_module) -> None:
        from vllm.lora.request import LoRARequest

        step = trainer.global_step
        record = self.sync.history[-1]
        assert record["step"] == step
        engine = self.sync.engine
        state = slots(engine)
        lora_id = max(i for i in state["slots"] if i is not None)
        ref = self.out / f"peft-{step}"
        pl_module.model.save_pretrained(str(ref))
        pushed = Path(record["checkpoint"])
        request = LoRARequest(f"policy@{step}~{lora_id}", lora_id, str(pushed))
        self.seen[step] = {
            "record": record,
            "print": state["prints"][str(lora_id)],
            "sample": sample(engine, request),
            "ref": ref,
            "pushed": {k: v.clone() for k, v in load_file(pushed / ADAPTER_WEIGHTS).items()},
            "config": json.loads((pushed / "adapter_config.json").read_text()),
            "listing": sorted(f.name for f in pushed.parent.iterdir() if f.name != ".owner"),
        }


def snapshot_callback(snapshot: Snapshot):
    from lightning.pytorch.callbacks import Callback

    class Take(Callback):
        def on_train_start(self, trainer, pl_module):
            snapshot.take(trainer, pl_module)

        def on_train_batch_end(self, trainer, pl_module, *args):
            snapshot.take(trainer, pl_module)

    return Take()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_sync_pushes_the_adapter_a_cold_start_serves(
    base: Path, tmp_path: Path, dtype: str
) -> None:
    from vllm.lora.request import LoRARequest

    args = {**ARGS, "dtype": dtype}
    spec = EngineSpec(model=str(base), options={"engine_args": args})  # no LoRA option given
    on_disk = dtype == "float32"  # bf16: the RAM transport's directory (keeps 1, recycles files)
    files = CheckpointFiles(dirpath=str(tmp_path / "syncs"), keep_last_k=2) if on_disk else None
    sync = VLLMWeightSync(engine=spec, files=files or CheckpointFiles())
    snapshot = Snapshot(sync, tmp_path)
    policy = policy_module(lora_policy(base))
    fit = trainer(tmp_path, [sync, snapshot_callback(snapshot)], max_steps=2)
    fit.fit(policy, train_dataloaders=[0] * 2)
    assert sorted(snapshot.seen) == [0, 1, 2]
    # only the newest keep_last_k adapter directories are left, none made a spare file
    newest = ["step-00000001.adapter", "step-00000002.adapter"][-2 if on_disk else -1 :]
    assert snapshot.seen[2]["listing"] == newest
    base_bytes = sum(t.nbytes for t in load_file(base / "model.safetensors").values())
    for seen in snapshot.seen.values():
        record = seen["record"]
        assert record["adapter"]["sent"] == "adapter" and record["mode"] == "adapter", record
        # what was pushed is what PEFT saves, names, bits and config; its bytes the adapter's
        want = load_file(seen["ref"] / ADAPTER_WEIGHTS)
        assert sorted(seen["pushed"]) == sorted(want)
        assert all(torch.equal(seen["pushed"][k], want[k]) for k in want)
        config = json.loads((seen["ref"] / "adapter_config.json").read_text())
        config.pop("auto_mapping")  # PEFT's own loader's hint for a model without a task type
        assert {k: v for k, v in seen["config"].items() if k != "auto_mapping"} == config
        assert record["bytes"] == sum(t.nbytes for t in want.values()) < base_bytes / 4
    # not vacuous: training moved the adapter, and each version samples its own logprobs
    assert len({str(s["print"]) for s in snapshot.seen.values()}) == 3
    assert len({str(s["sample"]) for s in snapshot.seen.values()}) == 3

    lora = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}
    cold = open_engine(base, key=("adapter-sync-cold", dtype), **args, **lora)
    for step, seen in snapshot.seen.items():
        lora_id = step + 1
        got = sample(cold, LoRARequest(f"cold-{step}", lora_id, str(seen["ref"])))
        assert slots(cold)["prints"][str(lora_id)] == seen["print"], step
        assert got == seen["sample"], step
        cold.llm.llm_engine.remove_lora(lora_id)


@pytest.mark.slow
def test_what_an_adapter_push_cannot_serve_pushes_merged_weights(
    base: Path, tmp_path: Path
) -> None:
    """Rank 520 (no vLLM slot holds it), and a plain adapter into an engine given without LoRA
    slots: each sync merges, its record says why, and the file holds PEFT's merged weights."""

    engine = open_engine(base, key=("adapter-sync-plain",), **ARGS)
    wide = lora_policy(base, r=520, lora_alpha=520, target_modules=["q_proj", "v_proj"])
    for model, why in ((wide, "rank 520 exceeds"), (lora_policy(base), "no LoRA slots")):
        files = CheckpointFiles(dirpath=str(tmp_path / why))
        sync = VLLMWeightSync(engine=engine, files=files)
        trainer(tmp_path, [sync], max_steps=1).fit(policy_module(model), train_dataloaders=[0])
        assert [r["adapter"]["sent"] for r in sync.history] == ["merged", "merged"]
        assert all(why in r["adapter"]["why"] for r in sync.history), sync.history
        last = load_file(sync.history[-1]["checkpoint"])  # the merged linears, base names
        merged = model.merge_and_unload().state_dict()
        assert last and all(".lora_" not in k for k in last)
        for name, t in last.items():
            torch.testing.assert_close(t, merged[name], rtol=0, atol=1e-5)
    close_engine()
