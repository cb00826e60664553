"""``VLLMWeightSync`` in real Lightning runs: real Trainer, real engine, real files.

The reference for what the engine serves is a cold start on the very checkpoint that was pushed
(copied into a model directory beside the original config and tokenizer).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers import (
    ENGINE_KWARGS,
    PushWatcher,
    TinyLM,
    assert_differs,
    assert_parity,
    close_engine,
    crash_before_rename,
    engine_options_cli,
    greedy,
    model_dir_with,
    trainer,
)
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger

from callbacks import (
    CanaryCheck,
    CheckpointFiles,
    CheckpointNames,
    EngineSpec,
    Schedule,
    VLLMWeightSync,
)
from weight_bridge.checkpoint import BASE_VERSION_KEY, CheckpointReader
from weight_bridge.checkpoint.format import HASH_KEY
from weight_bridge.exact import exact_fingerprint, format_fingerprint
from weight_bridge.sync.canary import CanaryError
from weight_bridge.sync.retention import prune


class Recorder(PushWatcher):
    """Listed after the sync callback: sees each push as it lands, with the weights it carried."""

    def __init__(self, sync: VLLMWeightSync, outputs: bool = False) -> None:
        super().__init__(sync)
        self.outputs = outputs

    def seen(self, trainer: pl.Trainer, pl_module: TinyLM, record: dict) -> dict:
        engine = self.sync.engine
        assert engine is not None
        return {
            "step": record["step"],
            "global_step": trainer.global_step,
            "version": engine.version,
            "checkpoint": record["checkpoint"],
            "weights": {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()},
            "greedy": greedy(engine) if self.outputs else None,
        }


def step_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def model_dir_for(models, checkpoint: str | Path, dst: Path) -> Path:
    """A model directory that cold-starts on ``checkpoint``: llama_A's config and tokenizer."""
    shutil.copytree(models["llama_A"], dst, ignore=shutil.ignore_patterns("*.safetensors"))
    shutil.copy(checkpoint, dst / "model.safetensors")
    return dst


def file_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    with CheckpointReader(path) as reader:
        if HASH_KEY in reader.metadata:  # a RAM transport file carries none (docs/sync.md)
            reader.verify_hash()
        return {name: t.clone() for name, t in reader.tensors()}


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


# -- cadence, content, parity --------------------------------------------------------------


def train_every_two_steps(models, engine, tmp_path: Path) -> tuple[Recorder, CSVLogger]:
    sync = VLLMWeightSync(
        engine=engine,
        schedule=Schedule(every_n_train_steps=2, delta="off"),  # each file: the full weights
        files=CheckpointFiles(keep_last_k=10),
    )
    recorder = Recorder(sync, outputs=True)
    logger = CSVLogger(tmp_path, name="run")
    trainer(tmp_path, [sync, recorder], max_steps=6, logger=logger).fit(
        TinyLM(str(models["llama_A"]))
    )
    assert engine.version == 6 and sync.last_pushed_step == 6
    assert [p["step"] for p in recorder.pushes] == [0, 2, 4, 6]
    return recorder, logger


def test_every_two_steps_pushes_the_trainer_weights(models, shared_engine, cold, tmp_path) -> None:
    recorder, logger = train_every_two_steps(models, shared_engine("llama_A"), tmp_path)
    out_dir = Path(logger.log_dir) / "weight_sync"
    assert step_files(out_dir) == [f"step-{s:08d}.safetensors" for s in (0, 2, 4, 6)]
    for i, push in enumerate(recorder.pushes):
        assert push["version"] == push["global_step"] == push["step"]
        assert Path(push["checkpoint"]) == out_dir / f"step-{push['step']:08d}.safetensors"
        assert_same_tensors(file_tensors(push["checkpoint"]), push["weights"])
        with CheckpointReader(push["checkpoint"]) as reader:
            meta = reader.metadata
        assert meta["step"] == meta["version"] == str(push["step"])
        assert meta["source_dtype"] == "float32"
        if i:
            assert_differs(push["greedy"], recorder.pushes[i - 1]["greedy"])  # training moved it
    last = recorder.pushes[-1]
    assert_parity(last["greedy"], cold(model_dir_for(models, last["checkpoint"], tmp_path / "c")))

    with open(Path(logger.log_dir) / "metrics.csv") as f:
        header, *rows = [line.rstrip("\n").split(",") for line in f]
    for key in ("weight_sync/save_s", "weight_sync/push_s", "weight_sync/bytes"):
        assert key in header
    column = header.index("weight_sync/version")
    assert [float(r[column]) for r in rows if r[column]] == [0.0, 2.0, 4.0, 6.0]


@pytest.mark.every_vllm
@pytest.mark.slow
def test_every_push_serves_like_a_cold_start(models, shared_engine, cold, tmp_path) -> None:
    recorder, _ = train_every_two_steps(models, shared_engine("llama_A"), tmp_path)
    references = [
        model_dir_for(models, push["checkpoint"], tmp_path / f"cold-{push['step']}")
        for push in recorder.pushes
    ]
    for push, reference in zip(recorder.pushes, cold.many(references), strict=True):
        assert_parity(push["greedy"], reference)


def test_the_default_schedule_measures_a_delta_on_a_disk_and_keeps_the_cheaper_kind(
    models, shared_engine, cold, tmp_path
) -> None:
    """``Schedule()`` as it comes (``delta="auto"``) writing to a disk, where a delta's few
    bytes may pay: the first sync (the trainer's dtype), a full sync once the engine reported
    its dtypes (measured), a keyframe that keeps the reference copy, a delta that probes (on
    the step synced before it, smaller than a complete file), then whichever kind the run
    measured cheaper, as each record says. After every push the engine holds the trainer's
    weights bit for bit (its fingerprint of every tensor it holds), and at the end it answers
    as a cold start on them."""
    engine = shared_engine("llama_A")
    sync = VLLMWeightSync(
        engine=engine,
        schedule=Schedule(every_n_train_steps=2),
        files=CheckpointFiles(dirpath=str(tmp_path / "ws"), keep_last_k=10),
    )

    class Held(PushWatcher):
        def seen(self, trainer, pl_module, record) -> dict:
            (held,) = engine.fingerprints()
            state = pl_module.model.state_dict()
            fp = {n: format_fingerprint(exact_fingerprint(state[n].detach())) for n in held}
            return {"step": record["step"], "held": len(held), "wrong": fp != held}

    watch = Held(sync)
    module = TinyLM(str(models["llama_A"]))
    trainer(tmp_path, [sync, watch], max_steps=8).fit(module)
    assert sync.schedule.delta == "auto" and engine.version == 8
    steps = (0, 2, 4, 6, 8)
    assert [(p["step"], p["wrong"]) for p in watch.pushes] == [(s, False) for s in steps]
    assert all(p["held"] == len(module.model.state_dict()) for p in watch.pushes)
    history = sync.history
    assert [h["delta"] for h in history[:4]] == [False, False, False, True]
    whys = [h["choice"]["why"] for h in history]
    assert whys[:4] == [
        "the engine reported no dtypes yet: it cannot apply a delta",
        "measuring a full sync first",
        f"probing a delta against a full sync ({history[2]['choice']['full_s']:.3f} s)",
        f"probing a delta against a full sync ({history[3]['choice']['full_s']:.3f} s)",
    ], whys
    full_s, probe = history[1]["save_s"] + history[1]["push_s"], history[3]
    assert history[3]["choice"]["full_s"] == pytest.approx(full_s)
    with CheckpointReader(probe["checkpoint"]) as reader:
        assert reader.is_delta and reader.metadata[BASE_VERSION_KEY] == str(history[2]["step"])
    assert probe["bytes"] < history[0]["bytes"] and 0 < probe["changed"] < 1
    # the fifth: the kind measured cheaper (the probe's save + push against the full sync's)
    last = history[4]["choice"]
    assert last["delta_s"] == pytest.approx(probe["save_s"] + probe["push_s"])
    assert history[4]["delta"] == (last["delta_s"] < full_s) == (last["sent"] == "delta")
    # last_checkpoint: the newest complete checkpoint (a delta loads nowhere on its own)
    complete = [h["checkpoint"] for h in history if not h["delta"] and not h["partial"]]
    assert sync.last_checkpoint == complete[-1]
    weights = {n: t.detach().clone() for n, t in module.model.state_dict().items()}
    trained = model_dir_with(models["llama_A"], weights, tmp_path / "trained")
    assert_parity(greedy(engine), cold(trained))


def test_gradient_accumulation_keeps_the_cadence_in_optimizer_steps(
    models, shared_engine, tmp_path
) -> None:
    engine = shared_engine("llama_A")
    sync = VLLMWeightSync(
        engine=engine,
        schedule=Schedule(every_n_train_steps=2),
        files=CheckpointFiles(dirpath=str(tmp_path / "ws")),
    )
    recorder = Recorder(sync)
    run = trainer(tmp_path, [sync, recorder], max_steps=4, accumulate_grad_batches=2)
    run.fit(TinyLM(str(models["llama_A"])))

    assert run.fit_loop.epoch_loop.batch_progress.total.completed == 8
    assert [p["step"] for p in recorder.pushes] == [0, 2, 4]
    assert all(p["version"] == p["global_step"] == p["step"] for p in recorder.pushes)
    assert engine.version == 4


def test_at_steps_and_train_end(models, shared_engine, tmp_path) -> None:
    engine = shared_engine("llama_A")
    sync = VLLMWeightSync(
        engine=engine,
        schedule=Schedule(every_n_train_steps=None, at_steps=(4, 1)),
        files=CheckpointFiles(dirpath=str(tmp_path / "ws"), keep_last_k=5),
    )
    trainer(tmp_path, [sync], max_steps=5).fit(TinyLM(str(models["llama_A"])))
    # the train start (the engine serves the trainer's weights first), the chosen steps, the end
    assert [h["step"] for h in sync.history] == [0, 1, 4, 5]
    assert step_files(tmp_path / "ws") == [f"step-{s:08d}.safetensors" for s in (0, 1, 4, 5)]
    assert engine.version == 5


# -- switching it off ----------------------------------------------------------------------


def test_disabled_does_nothing(models, shared_engine, tmp_path) -> None:
    engine = shared_engine("llama_A")
    before = (engine.version, engine.checkpoint)
    for kwargs in ({"engine": engine}, {"engine": EngineSpec(model=str(models["llama_A"]))}):
        files = CheckpointFiles(dirpath=str(tmp_path / "ws"))
        sync = VLLMWeightSync(enabled=False, files=files, **kwargs)
        module = TinyLM(str(models["llama_A"]))
        trainer(tmp_path, [sync], max_steps=2).fit(module)
        assert module.vllm_engine is None
        assert sync.history == [] and sync.last_pushed_step is None
        assert not (tmp_path / "ws").exists()
        assert (engine.version, engine.checkpoint) == before
    assert sync.engine is None  # nothing was built from the spec


# -- files ---------------------------------------------------------------------------------


def test_keeps_the_last_k_and_never_the_served_one(models, shared_engine, tmp_path) -> None:
    engine = shared_engine("llama_A")
    out = tmp_path / "ws"

    class ShortHistory(VLLMWeightSync):
        history_limit = 3

    files = CheckpointFiles(dirpath=str(out), keep_last_k=2)
    sync = ShortHistory(engine=engine, schedule=Schedule(delta="off"), files=files)
    seen: list[list[str]] = []

    class Watch(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(step_files(out))
            assert engine.checkpoint is not None and Path(engine.checkpoint).is_file()

    trainer(tmp_path, [sync, Watch()], max_steps=5).fit(TinyLM(str(models["llama_A"])))
    names = [f"step-{s:08d}.safetensors" for s in range(6)]
    assert seen == [names[0:2], names[1:3], names[2:4], names[3:5], names[4:6]]
    assert step_files(out) == names[4:6]
    assert [h["step"] for h in sync.history] == [3, 4, 5]  # bounded: the last history_limit

    # An engine serving an older file (pushed by someone else) keeps it across pruning.
    shutil.copy(out / names[4], out / names[1])
    engine.push(out / names[1], version="rollback")
    prune(out, out / names[5], 2, engine.served_checkpoints)
    assert step_files(out) == [names[1], names[4], names[5]]


def test_names_and_dtype_are_converted(models, shared_engine, tmp_path) -> None:
    """A wrapper's prefix is stripped, names are rewritten, weights are cast before saving."""
    engine = shared_engine("llama_A")

    def wrapped(m: TinyLM) -> dict:
        state = m.model.state_dict()
        return {"policy." + k.replace("model.", "backbone.", 1): v for k, v in state.items()}

    sync = VLLMWeightSync(
        engine=engine,
        source=wrapped,
        names=CheckpointNames(
            rename={r"^policy\.": "", r"^backbone\.": "model."}, dtype="bfloat16"
        ),
        files=CheckpointFiles(dirpath=str(tmp_path / "ws")),
    )
    module = TinyLM(str(models["llama_A"]))
    trainer(tmp_path, [sync], max_steps=1).fit(module)
    assert engine.version == 1  # the float32 engine takes the bfloat16 file, casting on reload
    path = tmp_path / "ws" / "step-00000001.safetensors"
    with CheckpointReader(path) as reader:
        assert reader.metadata["source_dtype"] == "float32"
    want = {k: v.to(torch.bfloat16) for k, v in module.model.state_dict().items()}
    assert_same_tensors(file_tensors(path), want)


def test_whole_module_state_through_the_strategy(models, shared_engine, tmp_path) -> None:
    """source="" takes the LightningModule's own state dict (as sharded strategies gather it)
    and a rename strips the attribute name Lightning puts in front."""
    engine = shared_engine("llama_A")
    sync = VLLMWeightSync(
        engine=engine,
        source="",
        names=CheckpointNames(rename={r"^model\.": ""}),
        files=CheckpointFiles(dirpath=str(tmp_path / "ws")),
    )
    module = TinyLM(str(models["llama_A"]))
    trainer(tmp_path, [sync], max_steps=1).fit(module)
    assert engine.version == 1
    assert_same_tensors(file_tensors(sync.last_checkpoint), module.model.state_dict())  # type: ignore[arg-type]


def test_bad_arguments_are_refused_up_front(models) -> None:
    path = str(models["llama_A"])
    spec = EngineSpec(model=path)
    for make, words in [
        (lambda: VLLMWeightSync(), "needs an engine"),
        (lambda: VLLMWeightSync(engine=spec, on_error="ignore"), "on_error"),
        (lambda: EngineSpec(), "a model to start an engine on, or a url"),
        (lambda: EngineSpec(model=path, url="http://x"), "a model to start an engine on, or a url"),
        (lambda: EngineSpec(model=path, mode="fast"), "engine mode must be one of"),
        (lambda: EngineSpec(url="http://x", mode="serve"), "already running"),
        (lambda: EngineSpec(model=path, options={"inflight": "drain"}), "inflight applies to mode"),
        (lambda: EngineSpec(model=path, options={"kv_cache_gbs": 1}), "mean 'kv_cache_gb'"),
        (lambda: EngineSpec(model=path, options={"verify_hash": 1}), "mean 'bridge.verify_hash'"),
        (lambda: EngineSpec(model=path, options={"engine_args": {"rollback": 0}}), "set bridge"),
        (lambda: EngineSpec(url="http://x", options={"kv_cache_gb": 1}), "kv_cache_gb applies to"),
        (lambda: CheckpointNames(dtype="int8"), "floating torch dtype"),
        (lambda: CheckpointFiles(keep_last_k=0), "keep_last_k"),
        (lambda: Schedule(every_n_train_steps=0), "every_n_train_steps"),
        (lambda: Schedule(at_steps=(-1,)), "at_steps"),
        (lambda: Schedule(full_every_k=0), "full_every_k"),
        (lambda: CanaryCheck(tolerance=0), "canary_tolerance"),
    ]:
        with pytest.raises(ValueError, match=words):
            make()
    assert not VLLMWeightSync(enabled=False).enabled  # disabled needs nothing


def test_options_are_grouped_and_flat_keywords_are_refused(models) -> None:
    """Only the groups configure the callback (no release had flat keywords); the cadence is
    read back from them."""
    path = str(models["llama_A"])
    spec = EngineSpec(model=path, mode="serve", options={"inflight": "drain"})
    sync = VLLMWeightSync(
        engine=spec,
        schedule=Schedule(every_n_train_steps=None, at_steps=(4, 1, 4), full_every_k=2),
        files=CheckpointFiles(dirpath="x", keep_last_k=3),
        names=CheckpointNames(rename={r"^model\.": ""}, dtype="bfloat16"),
        canary=CanaryCheck(tolerance=0.1),
    )
    assert sync.spec == spec and sync.engine is None  # started in setup
    assert sync.schedule == Schedule(every_n_train_steps=None, at_steps=(1, 4), full_every_k=2)
    assert sync.files == CheckpointFiles(dirpath="x", keep_last_k=3)
    assert sync.names == CheckpointNames(rename={r"^model\.": ""}, dtype="bfloat16")
    assert sync.canary == CanaryCheck(tolerance=0.1)
    for flat in ({"every_n_train_steps": 4}, {"dirpath": "x"}, {"model_path": path}):
        with pytest.raises(TypeError, match=next(iter(flat))):
            VLLMWeightSync(engine=spec, **flat)  # type: ignore[arg-type]


# -- failures ------------------------------------------------------------------------------


@pytest.mark.parametrize("on_error", ["raise", "warn"])
def test_crash_between_write_and_rename_leaves_the_previous_checkpoint(
    models, shared_engine, tmp_path, monkeypatch, on_error
) -> None:
    engine = shared_engine("llama_A")
    out = tmp_path / "ws"
    files = CheckpointFiles(dirpath=str(out), keep_last_k=5)
    sync = VLLMWeightSync(engine=engine, files=files, on_error=on_error)
    crash_before_rename(monkeypatch, "step-00000002.safetensors")
    module = TinyLM(str(models["llama_A"]))
    run = trainer(tmp_path, [sync], max_steps=3)
    if on_error == "raise":
        with pytest.raises(OSError, match="injected crash"):
            run.fit(module)
        assert step_files(out) == ["step-00000000.safetensors", "step-00000001.safetensors"]
        assert engine.version == 1
    else:
        with pytest.warns(UserWarning, match="save of step 2 failed.*injected crash"):
            run.fit(module)
        assert step_files(out) == [f"step-0000000{s}.safetensors" for s in (0, 1, 3)]
        assert engine.version == 3
    monkeypatch.undo()
    file_tensors(out / "step-00000001.safetensors")  # complete: the hash still verifies
    engine.push(out / "step-00000001.safetensors", version=1, verify_hash=True)
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


@pytest.mark.every_vllm
def test_rejected_push_keeps_the_last_good_version(models, shared_engine, tmp_path) -> None:
    engine = shared_engine("llama_A")

    def poisoned_at_step_2(m: TinyLM) -> dict:
        state = dict(m.model.state_dict())
        if m.trainer.global_step == 2:
            state["model.norm.weight"] = torch.full_like(state["model.norm.weight"], float("nan"))
        return state

    sync = VLLMWeightSync(
        engine=engine,
        source=poisoned_at_step_2,
        files=CheckpointFiles(dirpath=str(tmp_path / "ws")),
        on_error="warn",
    )
    versions: list[object] = []

    class Watch(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            versions.append(engine.version)
            greedy(engine, max_tokens=1)  # still serving

    with pytest.warns(UserWarning, match="push of step 2 failed"):
        trainer(tmp_path, [sync, Watch()], max_steps=4).fit(TinyLM(str(models["llama_A"])))
    assert versions == [1, 1, 3, 4]
    assert [h["step"] for h in sync.history] == [0, 1, 3, 4]


def test_canary_logs_the_logprob_gap_and_fails_when_the_engine_serves_something_else(
    models, shared_engine, tmp_path
) -> None:
    engine = shared_engine("llama_A")
    ok = CheckpointFiles(dirpath=str(tmp_path / "ok"))
    sync = VLLMWeightSync(engine=engine, files=ok, canary=True)
    trainer(tmp_path, [sync], max_steps=2).fit(TinyLM(str(models["llama_A"])))
    gaps = [h["canary_gap"] for h in sync.history]
    assert len(gaps) == 3 and all(g is not None and g < 1e-4 for g in gaps)

    def wrong_names(m: TinyLM) -> dict:
        # a name mapping bug in the user's code: two layers' MLPs swapped in the checkpoint
        state = dict(m.model.state_dict())
        swap = "model.layers.{}.mlp.down_proj.weight"
        state[swap.format(0)], state[swap.format(1)] = state[swap.format(1)], state[swap.format(0)]
        return state

    bad = VLLMWeightSync(
        engine=engine,
        source=wrong_names,
        files=CheckpointFiles(dirpath=str(tmp_path / "bad")),
        canary=True,
    )
    with pytest.raises(CanaryError, match="differ from the trainer's"):
        trainer(tmp_path, [bad], max_steps=1).fit(TinyLM(str(models["llama_A"])))


# -- resume ------------------------------------------------------------------------------


def test_resumed_run_pushes_its_restored_weights_first(models, shared_engine, tmp_path) -> None:
    engine = shared_engine("llama_A")
    every_2 = Schedule(every_n_train_steps=2, delta="off")  # step 4's file: the full weights
    first = VLLMWeightSync(
        engine=engine, schedule=every_2, files=CheckpointFiles(dirpath=str(tmp_path / "one"))
    )
    run = trainer(tmp_path, [first], max_steps=4)
    run.fit(TinyLM(str(models["llama_A"])))
    ckpt = tmp_path / "run.ckpt"
    run.save_checkpoint(ckpt)
    at_4 = greedy(engine)
    state = torch.load(ckpt, weights_only=False)["callbacks"][first.state_key]
    assert state == {
        "last_pushed_step": 4,
        "last_checkpoint": str(tmp_path / "one" / "step-00000004.safetensors"),
    }

    engine.push(models["llama_B"], version="elsewhere")  # as a fresh engine would serve
    second = VLLMWeightSync(
        engine=engine,
        schedule=Schedule(every_n_train_steps=2, delta="off"),
        files=CheckpointFiles(dirpath=str(tmp_path / "two")),
    )
    recorder = Recorder(second, outputs=True)
    trainer(tmp_path, [second, recorder], max_steps=6).fit(
        TinyLM(str(models["llama_A"])), ckpt_path=ckpt
    )
    assert [p["step"] for p in recorder.pushes] == [4, 6]
    assert recorder.pushes[0]["version"] == 4
    assert_parity(recorder.pushes[0]["greedy"], at_4)
    assert_same_tensors(
        file_tensors(tmp_path / "two" / "step-00000004.safetensors"),
        file_tensors(tmp_path / "one" / "step-00000004.safetensors"),
    )
    assert second.last_pushed_step == engine.version == 6


# -- engines of their own --------------------------------------------------------------


def test_tied_weights_are_written_once(models, engine_factory, cold, tmp_path) -> None:
    """Qwen2 ties lm_head to the embeddings: one tensor in the file, as save_pretrained does."""
    engine = engine_factory(models["qwen2_A"])
    sync = VLLMWeightSync(engine=engine, files=CheckpointFiles(dirpath=str(tmp_path / "ws")))
    module = TinyLM(str(models["qwen2_A"]))
    assert module.model.lm_head.weight is module.model.model.embed_tokens.weight
    trainer(tmp_path, [sync], max_steps=1).fit(module)
    written = file_tensors(sync.last_checkpoint)  # type: ignore[arg-type]
    assert "lm_head.weight" not in written
    state = module.model.state_dict()
    state.pop("lm_head.weight")
    assert_same_tensors(written, state)
    reference = tmp_path / "cold"
    shutil.copytree(models["qwen2_A"], reference, ignore=shutil.ignore_patterns("*.safetensors"))
    shutil.copy(sync.last_checkpoint, reference / "model.safetensors")  # type: ignore[arg-type]
    assert_parity(greedy(engine), cold(reference))


def test_lightning_cli_builds_the_callback_and_its_engine(models, tmp_path, monkeypatch) -> None:
    from lightning.pytorch.cli import LightningCLI

    close_engine()  # the callback builds its own in-process engine
    config = {
        "trainer": {
            "accelerator": "cpu",
            "max_steps": 3,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "default_root_dir": str(tmp_path),
            "callbacks": [
                {
                    "class_path": "callbacks.VLLMWeightSync",
                    "init_args": {
                        "engine": {
                            "model": str(models["llama_A"]),
                            "options": {"engine_args": ENGINE_KWARGS},
                        },
                        "schedule": {"every_n_train_steps": 2},
                        "files": {"ram_dir": True},
                    },
                }
            ],
        },
        "model": {"model_path": str(models["llama_A"]), "rollout": True},
    }
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML

    def cli(*extra: str) -> LightningCLI:
        args = ["--config", str(path), *extra]
        return LightningCLI(TinyLM, run=False, args=args, save_config_callback=None)

    def sync_of(c: LightningCLI) -> VLLMWeightSync:
        (found,) = [cb for cb in c.trainer.callbacks if isinstance(cb, VLLMWeightSync)]  # type: ignore[attr-defined]
        return found

    assert not sync_of(cli("--trainer.callbacks.init_args.enabled=false")).enabled
    override = sync_of(cli("--trainer.callbacks.init_args.files.keep_last_k=7"))  # one field
    assert override.files == CheckpointFiles(ram_dir=True, keep_last_k=7)
    assert override.schedule.every_n_train_steps == 2
    with pytest.raises(SystemExit):  # a flat keyword is not an option of the callback
        cli("--trainer.callbacks.init_args.keep_last_k=7")
    spec = sync_of(cli("--trainer.callbacks.init_args.engine.mode=serve")).spec  # one field
    assert (spec.model, spec.mode) == (str(models["llama_A"]), "serve")
    assert spec.options.engine_args.keys() == ENGINE_KWARGS.keys()

    c = cli()
    sync = sync_of(c)
    assert sync.enabled and sync.schedule.every_n_train_steps == 2 and sync.engine is None
    c.trainer.fit(c.model)
    assert c.model.rollout_versions == ["0", "0", "2"]  # each step: the newest push's label
    assert [h["step"] for h in sync.history] == [0, 2, 3]
    assert sync.engine is None and c.model.vllm_engine is None  # built in setup, closed after
    assert not Path(sync.history[-1]["checkpoint"]).parent.exists()  # the RAM dir is gone


@pytest.mark.parametrize(
    "options, words",
    [
        ("{kv_cache_gbs: 1}", "unknown engine option 'kv_cache_gbs' (did you mean 'kv_cache_gb'?)"),
        ("{bridge: {readbak: full}}", "unknown bridge option 'readbak' (did you mean 'readback'?)"),
        ("{cpu_threads_bind: '1'}", "cpu_threads_bind applies to mode async or ranks, not serve"),
    ],
)
def test_a_misspelt_engine_option_in_yaml_fails_as_the_cli_parses_it(
    models, tmp_path, options, words
) -> None:
    """The engine's options are typed: LightningCLI refuses a misspelt one by name, with the
    closest valid one, or one that does not apply to the mode, as it builds the callback from
    the YAML (before any trainer or engine)."""
    with pytest.raises(ValueError, match=re.escape(words)):
        engine_options_cli(models["llama_A"], tmp_path, options)


class RankReport(Callback):
    """Under ``ddp_spawn`` each rank runs in a process of its own: it writes what it saw."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module):
        (sync,) = [cb for cb in trainer.callbacks if isinstance(cb, VLLMWeightSync)]
        engine = pl_module.vllm_engine
        report = {
            "version": engine.version,
            "checkpoint": engine.checkpoint,
            "pushed": [h["step"] for h in sync.history],
            "rollouts": pl_module.rollout_versions,
            "greedy": greedy(engine),
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))
        if trainer.is_global_zero:
            shutil.copy(engine.checkpoint, self.out / "final.safetensors")


@pytest.mark.slow
def test_ddp_ranks_share_one_checkpoint_and_each_push_their_engine(
    models, cold, tmp_path, monkeypatch
) -> None:
    """Two CPU ranks, each with its own engine: rank 0 writes, both push the same file, and
    every rank's engine then equals a cold start on it.

    The RAM directory is named after rank 0's pid, so the ranks agree on it only through the
    broadcast. The engine core runs in its own process (vLLM's default), as it would beside a
    Lightning DDP job, keeping vLLM's process group apart from Lightning's.
    """
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    sync = VLLMWeightSync(
        engine=EngineSpec(model=str(models["llama_A"]), options={"engine_args": ENGINE_KWARGS}),
        schedule=Schedule(every_n_train_steps=2, delta="off"),  # final.safetensors: complete
        files=CheckpointFiles(ram_dir=True),
    )
    module = TinyLM(str(models["llama_A"]), rollout=True)
    run = trainer(
        tmp_path, [sync, RankReport(tmp_path)], max_steps=3, devices=2, strategy="ddp_spawn"
    )
    run.fit(module)

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for report in ranks:
        assert report["version"] == 3 and report["pushed"] == [0, 2, 3]
        assert report["rollouts"] == ["0", "0", "2"]
    assert ranks[0]["checkpoint"] == ranks[1]["checkpoint"]
    assert Path(ranks[0]["checkpoint"]).name == "step-00000003.safetensors"
    assert not Path(ranks[0]["checkpoint"]).parent.exists()  # rank 0 removed its RAM dir
    # ddp_spawn hands rank 0's trained weights back to this process: they are what was pushed.
    assert_same_tensors(file_tensors(tmp_path / "final.safetensors"), module.model.state_dict())
    reference = cold(model_dir_for(models, tmp_path / "final.safetensors", tmp_path / "cold"))
    for report in ranks:  # each rank's engine, not only rank 1 against rank 0
        assert_parity(report["greedy"], reference)
