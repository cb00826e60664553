"""A real pretrained model end to end: SmolLM2-135M-Instruct (``weight_bridge.testing.real_model``).

* vLLM's default multi-process engine, run from its own process (``python tests/test_real_model.py
  push A B OUT``): push a perturbed copy B, then A back; B pushed equals a cold start on B and A
  pushed back equals A as first served (greedy text and tokens, top-3 logprobs of every generated
  token and of every prompt token, to 1e-4), every address unchanged.
* ``VLLMWeightSync`` in a real Lightning ``Trainer`` fine-tuning the real model and pushing its
  checkpoints every step, deltas after the keyframe (the default): every file writes the tied
  embedding once, the engine then holds the trainer's weights bit for bit (fingerprints) and
  answers exactly as a cold start on them.

Prompts are chat questions in the model's own chat template (real tokenizer). One engine start per
scenario, plus one cold start each: a few minutes on 2 cores.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from weight_bridge.testing import real_model

QUESTIONS = [
    "What is the capital of France?",
    "What is 7 + 5? Answer with the number only.",
    "Name three colours of the rainbow.",
]
# The engine under test and its cold-start reference use the same configuration.
ENGINE_KWARGS: dict[str, Any] = dict(
    dtype="float32", max_model_len=256, max_num_seqs=4, enforce_eager=True, seed=0
)
TOLERANCE = 1e-4  # float32 reduction-order noise, far below any pushed change

pytestmark = [
    pytest.mark.slow,
    pytest.mark.must_run_in_ci,  # `make setup` installs the model: CI must not skip it
    pytest.mark.skipif(real_model.available() is not None, reason=str(real_model.available())),
]


# -- what parity is judged on ------------------------------------------------------------------


def answers(engine: Any, model_dir: str | Path, max_tokens: int = 24) -> list[dict]:
    """Greedy answers to :data:`QUESTIONS`: text, tokens, top-3 logprobs of each generated token
    (as sorted ``[token, logprob]`` pairs) and each prompt token's own logprob (``[[token,
    logprob]]``)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = real_model.chat_prompts(model_dir, QUESTIONS)
    params = {"temperature": 0.0, "max_tokens": max_tokens, "logprobs": 3, "prompt_logprobs": 3}
    out = []
    for g in engine.generate(prompts, params):
        c = g.completions[0]
        out.append(
            {
                "text": tokenizer.decode(c.token_ids, skip_special_tokens=True),
                "tokens": list(c.token_ids),
                "logprobs": [sorted([k, v] for k, v in step.items()) for step in c.top_logprobs],
                "prompt_logprobs": [
                    None if lp is None else [[t, lp]]
                    for t, lp in zip(g.prompt_token_ids, g.prompt_logprobs, strict=True)
                ],
            }
        )
    return out


def _max_gap(got: list, want: list) -> float:
    """Largest logprob difference between two per-position lists of ``[token, logprob]`` pairs,
    which must name the same tokens."""
    worst = 0.0
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if g is None or w is None:
            assert g is None and w is None
            continue
        assert [k for k, _ in g] == [k for k, _ in w]
        worst = max([worst] + [abs(a - b) for (_, a), (_, b) in zip(g, w, strict=True)])
    return worst


def assert_same_answers(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g["text"] == w["text"]
        assert g["tokens"] == w["tokens"]
        assert _max_gap(g["logprobs"], w["logprobs"]) <= TOLERANCE
        assert _max_gap(g["prompt_logprobs"], w["prompt_logprobs"]) <= TOLERANCE


def prompt_logprob_change(a: list[dict], b: list[dict]) -> float:
    """The largest change of the prompt tokens' own logprobs between two sets of answers."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        for px, py in zip(x["prompt_logprobs"], y["prompt_logprobs"], strict=True):
            if px is not None and py is not None:
                dx, dy = dict((k, v) for k, v in px), dict((k, v) for k, v in py)
                worst = max([worst] + [abs(dx[k] - dy[k]) for k in dx.keys() & dy.keys()])
    return worst


# -- scenarios run in a process of their own ---------------------------------------------------


def _scenario_push(model_a: str, model_b: str) -> dict:
    """Engine on A; push B, push A back; then a cold start on B. vLLM's default multi-process
    engine unless the environment says otherwise."""
    import psutil

    from weight_bridge import ColocatedEngine

    result: dict[str, Any] = {}
    # A lives in the model cache, outside the tests' checkpoint root (the temporary directory):
    # push a copy of its file from there, as a trainer's checkpoint would be
    a_file = Path(model_b).parent / "A.safetensors"
    shutil.copyfile(Path(model_a) / "model.safetensors", a_file)
    with ColocatedEngine(model_a, kv_cache_gb=0.25, **ENGINE_KWARGS) as engine:
        result["startup_s"] = engine.startup_s
        result["engine_processes"] = [p.name() for p in psutil.Process().children(recursive=True)]
        result["a_first"] = answers(engine, model_a)
        before = engine.addresses()
        reports = [engine.push(Path(model_b) / "model.safetensors", version=1)]
        result["b_pushed"] = answers(engine, model_a)
        reports.append(engine.push(a_file, version=2))
        result["a_pushed"] = answers(engine, model_a)
        after = engine.addresses()
        result["workers"] = len(before)
        result["weights"] = len(before[0])
        result["addresses_unchanged"] = after == before
        result["reports"] = [dataclasses.asdict(r) for r in reports]
    with ColocatedEngine(model_b, kv_cache_gb=0.25, **ENGINE_KWARGS) as engine:
        result["b_cold"] = answers(engine, model_b)
    return result


def _scenario_cold(model: str) -> dict:
    from weight_bridge import ColocatedEngine

    with ColocatedEngine(model, **ENGINE_KWARGS) as engine:
        return {"cold": answers(engine, model)}


def run_scenario(*args: str, multiprocess: bool, tmp_path: Path, timeout: int = 900) -> dict:
    out = tmp_path / f"{args[0]}-result.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0"}
    if args[0] == "push":
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the engine's own kv_cache_gb decides
    proc = subprocess.run(
        [sys.executable, __file__, *args, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    return json.loads(out.read_text())


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_a() -> Path:
    return real_model.real_model_dir()


@pytest.fixture(scope="module")
def model_b(model_a: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from weight_bridge.testing.models import perturb_checkpoint

    return perturb_checkpoint(model_a, tmp_path_factory.mktemp("real") / "B", scale=0.05, seed=1)


# -- tests -------------------------------------------------------------------------------------


def test_fixture_is_a_float32_llama_with_its_chat_template(model_a: Path) -> None:
    from safetensors import safe_open

    config = json.loads((model_a / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    assert "quantization_config" not in config
    with safe_open(str(model_a / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())  # noqa: SIM118
        assert {str(f.get_slice(n).get_dtype()) for n in names} == {"F32"}
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    prompt = real_model.chat_prompts(model_a, ["Hi"])[0]
    assert prompt.startswith("<|im_start|>system") and prompt.endswith("<|im_start|>assistant\n")
    # Cached: a second call finds it current and does not rebuild.
    stamp = (model_a / real_model.STAMP_FILE).stat().st_mtime_ns
    assert real_model.real_model_dir() == model_a
    assert (model_a / real_model.STAMP_FILE).stat().st_mtime_ns == stamp


def test_missing_or_stale_directory_is_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[Path] = []

    def fake_build(out: Path) -> None:  # the layout only; the conversion is tested above
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"")
        (out / real_model.STAMP_FILE).write_text(json.dumps(real_model._stamp()))
        built.append(out)

    monkeypatch.setattr(real_model, "_build", fake_build)
    target = tmp_path / "model"
    assert real_model.real_model_dir(target) == target and len(built) == 1
    assert real_model.real_model_dir(target) == target and len(built) == 1  # current: kept
    stamp = json.loads((target / real_model.STAMP_FILE).read_text())
    (target / real_model.STAMP_FILE).write_text(json.dumps({**stamp, "version": "0.0.1"}))
    real_model.real_model_dir(target)
    assert len(built) == 2  # another package version: rebuilt
    (target / "model.safetensors").unlink()
    real_model.real_model_dir(target)
    assert len(built) == 3 and (target / "model.safetensors").exists()  # incomplete: rebuilt
    monkeypatch.setenv(real_model.DIR_ENV, str(tmp_path / "elsewhere"))
    assert real_model.default_dir() == tmp_path / "elsewhere"


def test_push_perturbed_and_back_in_the_multiprocess_engine(
    model_a: Path, model_b: Path, tmp_path: Path
) -> None:
    r = run_scenario("push", str(model_a), str(model_b), multiprocess=True, tmp_path=tmp_path)
    assert any("EngineCore" in name for name in r["engine_processes"]), r["engine_processes"]
    assert r["workers"] == 1 and r["addresses_unchanged"]
    assert [p["mode"] for p in r["reports"]] == ["direct", "direct"]
    assert r["reports"][0]["bytes"] > 500e6  # the whole model, every push
    # The real model answers sensibly, and the perturbation shows in what it serves.
    assert "Paris" in r["a_first"][0]["text"]
    assert prompt_logprob_change(r["a_first"], r["b_pushed"]) > 1e-2
    assert_same_answers(r["b_pushed"], r["b_cold"])
    assert_same_answers(r["a_pushed"], r["a_first"])
    push_s = [round(p["elapsed_s"], 3) for p in r["reports"]]
    print(
        f"\nreal model: startup {r['startup_s']:.1f} s, pushes {push_s} s, {r['weights']} weights"
    )


def test_callback_pushes_real_model_checkpoints_from_a_trainer(
    model_a: Path, tmp_path: Path
) -> None:
    import lightning.pytorch as pl
    import torch
    from helpers import close_engine
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader

    from callbacks import CheckpointFiles, EngineSpec, Schedule, VLLMWeightSync
    from weight_bridge.checkpoint import BASE_VERSION_KEY, CheckpointReader, save_checkpoint
    from weight_bridge.delta.format import split_name
    from weight_bridge.exact import exact_fingerprint, format_fingerprint

    close_engine()  # one in-process engine at a time in this process

    class ChatLM(pl.LightningModule):
        """The real model fine-tuned (plain SGD) on one chat exchange in its own template."""

        def __init__(self) -> None:
            super().__init__()
            from transformers import AutoModelForCausalLM, AutoTokenizer

            self.model = AutoModelForCausalLM.from_pretrained(model_a, dtype=torch.float32)
            self.model.train()
            tok = AutoTokenizer.from_pretrained(str(model_a))
            chat = [
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Lyon."},
            ]
            text = tok.apply_chat_template(chat, tokenize=False)
            self.ids = torch.tensor([tok(str(text))["input_ids"]])

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.model.parameters(), lr=2e-3)

        def train_dataloader(self) -> DataLoader:
            return DataLoader([self.ids[0]] * 8, batch_size=1)  # type: ignore[arg-type]

    class Record(Callback):
        """After the sync callback in the list: sees every push land."""

        def __init__(self, sync: VLLMWeightSync) -> None:
            self.sync = sync
            self.first: list[dict] | None = None
            self.last: list[dict] | None = None
            self.weights: dict[str, torch.Tensor] = {}
            self.held: dict[str, str] = {}

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.first = answers(self.sync.engine, model_a)

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.last = answers(self.sync.engine, model_a)
            state = pl_module.model.state_dict()  # type: ignore[union-attr, operator]
            self.weights = {k: v.detach().clone() for k, v in state.items()}
            (self.held,) = self.sync.engine.fingerprints()  # type: ignore[union-attr]

    sync = VLLMWeightSync(
        engine=EngineSpec(model=str(model_a), options={"engine_args": ENGINE_KWARGS}),
        schedule=Schedule(every_n_train_steps=1, delta="on"),  # deltas: measured on a disk
        files=CheckpointFiles(dirpath=str(tmp_path / "checkpoints"), keep_last_k=1),
    )
    record = Record(sync)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=3,
        callbacks=[sync, record],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(ChatLM())
    assert sync.engine is None  # the callback closed the engine it built

    assert [h["step"] for h in sync.history] == [0, 1, 2, 3]
    assert {h["mode"] for h in sync.history} == {"direct"}
    last = Path(sync.history[-1]["checkpoint"])
    assert last.name == "step-00000003.safetensors"
    # Deltas: a complete sync, a keyframe once the engine reported its dtypes, then deltas
    # (only what changed since the step before).
    assert [h["delta"] for h in sync.history] == [False, False, True, True]
    with CheckpointReader(last) as reader:
        assert reader.is_delta and reader.metadata[BASE_VERSION_KEY] == "2"
    # last_checkpoint names the newest complete checkpoint (the keyframe: a delta loads nowhere)
    assert Path(sync.last_checkpoint or "").name == "step-00000001.safetensors"
    with CheckpointReader(sync.last_checkpoint) as reader:
        assert not reader.is_delta and BASE_VERSION_KEY not in reader.metadata
    # Every file left (the served chain's: its complete base among them) writes the tied
    # embedding once, and a complete one every other weight of the trainer's.
    untied = record.weights.keys() - {"lm_head.weight"}
    complete = 0
    for path in sorted((tmp_path / "checkpoints").glob("step-*.safetensors")):
        with CheckpointReader(path) as reader:
            names = {split_name(n)[0] for n in reader.specs()}
            assert names <= untied, path
            complete += not reader.is_delta
            assert reader.is_delta or names == untied, path
    assert complete >= 1
    # After the last push the engine holds the trainer's weights bit for bit, every one.
    assert record.held.keys() == untied
    for name, fingerprint in record.held.items():
        assert fingerprint == format_fingerprint(exact_fingerprint(record.weights[name])), name

    # Training moved the policy the engine serves, and it serves it exactly.
    assert record.first is not None and record.last is not None
    assert prompt_logprob_change(record.first, record.last) > 1e-3
    cold_dir = tmp_path / "cold"
    cold_dir.mkdir()
    for f in model_a.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (cold_dir / f.name).symlink_to(f)
    save_checkpoint({n: record.weights[n] for n in untied}, cold_dir / "model.safetensors")
    cold = run_scenario("cold", str(cold_dir), multiprocess=False, tmp_path=tmp_path)["cold"]
    assert_same_answers(record.last, cold)
    push_s = [round(h["push_s"], 3) for h in sync.history]
    print(f"\ncallback pushes of the real model (s): {push_s}")


def main() -> None:
    scenario, *paths, out = sys.argv[1:]
    result = _scenario_push(*paths) if scenario == "push" else _scenario_cold(*paths)
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
