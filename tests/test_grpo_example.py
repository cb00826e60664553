"""The GRPO recipe (``examples/grpo``), shortened: the real CLI, Trainer, engine and sync callback.

Each case runs ``train.py``'s LightningCLI on the recipe's own ``config.yaml`` with the paths moved
into a temporary directory and a few steps, then checks what the recipe promises: rollouts tagged
with the version they were sampled from, a float32-noise logprob gap while syncing, and a last
checkpoint on disk that holds exactly the trainer's weights.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import yaml
from helpers import close_engine
from safetensors.torch import load_file

RECIPE = Path(__file__).resolve().parents[1] / "examples" / "grpo"

pytestmark = pytest.mark.slow


def _recipe() -> ModuleType:
    spec = importlib.util.spec_from_file_location("grpo_recipe_train", RECIPE / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _config(tmp_path: Path, steps: int, overlay: str | None = None, **sync: object) -> Path:
    """``config.yaml`` (with an ``overlay``'s trainer, model and callback options) with every
    path under ``tmp_path`` (the checkpoints' ``files.dirpath`` too, unless the overlay clears
    it: none goes to ``./runs``) and the callback's options overridden (an option group given as
    a mapping, e.g. ``schedule={"every_n_train_steps": 4}``, replaces that group)."""
    cfg = yaml.safe_load((RECIPE / "config.yaml").read_text())
    if overlay is not None:
        extra = yaml.safe_load((RECIPE / overlay).read_text())
        paths = ("model_dir", "run_dir")  # moved under tmp_path below (the engine's model too)
        cfg["model"].update({k: v for k, v in extra.get("model", {}).items() if k not in paths})
        own = ("callbacks", "logger", "default_root_dir")  # set below
        cfg["trainer"].update({k: v for k, v in extra["trainer"].items() if k not in own})
        for cb in extra["trainer"].get("callbacks", []):
            options = {k: v for k, v in cb["init_args"].items() if k not in paths}
            sync = {**options, **sync}
    run, model_dir = tmp_path / "run", tmp_path / "policy-init"
    trainer = cfg["trainer"]
    trainer["max_steps"] = steps
    trainer["default_root_dir"] = str(run)
    trainer["logger"]["init_args"]["save_dir"] = str(run)
    (callback,) = [c for c in trainer["callbacks"] if c["class_path"].endswith("VLLMWeightSync")]
    init_args = callback["init_args"]
    init_args.update(**sync)
    init_args["engine"] = {**init_args["engine"], "model": str(model_dir)}
    files = init_args.get("files", {})
    if files.get("dirpath", "") is not None:  # None: no file (ranks.yaml: pushed from memory)
        init_args["files"] = {**files, "dirpath": str(run / "checkpoints")}
    cfg["model"].update(model_dir=str(model_dir), run_dir=str(run))
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _fit(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    steps: int,
    overlay: str | None = None,
    **sync: object,
):
    close_engine()  # one in-process vLLM engine at a time
    monkeypatch.setattr(sys, "argv", [str(RECIPE / "train.py")])  # not pytest's arguments
    monkeypatch.delenv("WEIGHT_BRIDGE_SYNC", raising=False)  # the YAML decides
    cli = _recipe().main(["fit", "--config", str(_config(tmp_path, steps, overlay, **sync))])
    (callback,) = [c for c in cli.trainer.callbacks if type(c).__name__ == "VLLMWeightSync"]
    # The callback closes the engine it built at teardown, the module the one it built itself.
    assert callback.engine is None and cli.model._own_engine is None
    return cli, callback


def test_sync_every_step_is_on_policy_and_checkpoints_hold_the_trainer_weights(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    steps = 5
    cli, callback = _fit(monkeypatch, tmp_path, steps)
    history = cli.model.history
    assert [h["step"] for h in history] == list(range(steps))
    # Rollouts of step N were sampled from the weights pushed at step N: staleness 0.
    assert [h["policy_version"] for h in history] == list(range(steps))
    assert all(h["staleness"] == 0 for h in history)
    # Trainer and engine agree on the sampled tokens' log-probabilities up to float32 noise.
    gaps = [h["logprob_gap"] for h in history]
    assert max(gaps) < 1e-3, gaps

    assert callback.last_pushed_step == steps
    # last_checkpoint: the newest complete checkpoint (delta="auto" may send deltas to this
    # disk where they measure cheaper; those load nowhere on their own), the trained weights
    # at its step; the final weights when the last sync was a full one
    checkpoint = Path(callback.last_checkpoint)
    assert checkpoint.is_file()
    (last,) = [h for h in callback.history if h["checkpoint"] == str(checkpoint)]
    assert not last["delta"] and not last["partial"]
    assert all(h["delta"] for h in callback.history if h["step"] > last["step"])
    saved = load_file(str(checkpoint))
    state = cli.model.model.state_dict()
    assert set(saved) == set(state)
    if last is callback.history[-1]:
        for name, tensor in state.items():
            assert torch.equal(saved[name], tensor), name
    initial = load_file(str(tmp_path / "policy-init" / "model.safetensors"))
    assert any(not torch.equal(initial[n], saved[n]) for n in saved)  # training moved them

    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == steps and summary["sync"]["enabled"]
    assert summary["sync"]["every_n_train_steps"] == 1
    assert summary["last_checkpoint"] == str(checkpoint)
    assert (run / "reward.png").stat().st_size > 0


def test_sync_every_4_steps_bounds_staleness(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cli, callback = _fit(monkeypatch, tmp_path, 6, schedule={"every_n_train_steps": 4})
    history = cli.model.history
    assert [h["policy_version"] for h in history] == [0, 0, 0, 0, 4, 4]
    assert [h["staleness"] for h in history] == [0, 1, 2, 3, 0, 1]
    assert history[0]["logprob_gap"] < 1e-3 and history[4]["logprob_gap"] < 1e-3
    assert callback.last_pushed_step == 6  # the last step, pushed at the end


def test_sync_off_samples_from_the_initial_policy(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cli, callback = _fit(monkeypatch, tmp_path, 4, enabled=False)
    history = cli.model.history
    assert [h["policy_version"] for h in history] == [0, 0, 0, 0]
    assert [h["staleness"] for h in history] == [0, 1, 2, 3]
    assert callback.last_checkpoint is None
    assert not (tmp_path / "run" / "checkpoints").exists()
    # The engine never moves while the trainer does: the gap opens after the first update.
    assert history[0]["logprob_gap"] < 1e-3 < history[-1]["logprob_gap"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["sync"]["enabled"] is False


def test_lora_overlay_pushes_only_the_adapter_and_stays_on_policy(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    steps = 4
    every_step = {"every_n_train_steps": 1, "skip_frozen": True, "delta": "off"}  # each a file
    cli, callback = _fit(monkeypatch, tmp_path, steps, "lora.yaml", schedule=every_step)
    history = cli.model.history
    assert [h["policy_version"] for h in history] == list(range(steps))
    # The trainer computes with base + adapters, the engine with the base and the newest slot.
    assert max(h["logprob_gap"] for h in history) < 1e-3
    pushes = callback.history
    assert [p["adapter"]["sent"] for p in pushes] == ["adapter"] * (steps + 1), pushes
    pushed = Path(pushes[-1]["checkpoint"])
    saved = load_file(pushed / "adapter_model.safetensors")
    # Only A and B of the adapted linears, under PEFT's saved names: no base weight at all.
    assert saved and all(".lora_A." in n or ".lora_B." in n for n in saved)
    assert all(p["bytes"] == sum(t.nbytes for t in saved.values()) for p in pushes)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["adapter_pushes"] == steps + 1


def test_async_overlay_overlaps_rollouts_and_training_within_the_staleness_bound(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``async.yaml``: an AsyncLLM engine generates the next step's rollouts while a step
    trains, pushes land in flight; every token carries the version that sampled it and none is
    more than ``max_staleness`` (1) steps old."""
    steps = 6
    cli, callback = _fit(monkeypatch, tmp_path, steps, "async.yaml")
    history = cli.model.history
    assert [h["step"] for h in history] == list(range(steps))
    assert all(0 <= h["staleness"] <= 1 for h in history), history
    assert history[0]["logprob_gap"] < 1e-3  # step 0 samples the weights the trainer starts on
    counts = cli.model.staleness_counts
    hp = cli.model.hparams
    assert sum(counts.values()) == steps * hp.prompts_per_step * hp.group_size * hp.max_new_tokens
    assert set(counts) <= {0, 1} and counts.get(1, 0) > 0  # generated while the step before trained
    assert callback.last_pushed_step == steps
    pushes = callback.history
    assert all(p["inflight"] == "recompute" for p in pushes[1:]), pushes
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["staleness_tokens"] == {str(k): v for k, v in sorted(counts.items())}
    assert summary["steps_per_s"] > 0


def test_server_overlay_trains_against_a_vllm_serve_process_and_stops_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``server.yaml``: a ``vllm serve`` process started for the run, rollouts and pushes over
    HTTP, on policy (the server computes what the trainer computes), stopped at the end."""
    import psutil

    steps = 4
    cli, callback = _fit(monkeypatch, tmp_path, steps, "server.yaml")
    history = cli.model.history
    assert [h["staleness"] for h in history] == [0] * steps
    assert max(h["logprob_gap"] for h in history) < 1e-3
    assert callback.last_pushed_step == steps
    servers = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "api_server" in " ".join(child.cmdline()):
                servers.append(child)
        except psutil.Error:  # gone, or a zombie of an engine process not reaped yet
            continue
    assert not servers


def _metrics(run: Path) -> list[dict[str, float]]:
    """The rows of the run's CSV log (rank zero's), the values it holds in each."""
    (path,) = sorted(run.glob("logs/version_*/metrics.csv"))
    with path.open() as f:
        return [{k: float(v) for k, v in r.items() if v} for r in csv.DictReader(f)]


def test_ranks_overlay_trains_in_two_ddp_ranks_on_policy_as_the_default_recipe(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``ranks.yaml``: two DDP ranks started by Lightning's own launcher (the recipe's command as
    a user runs it, in a subprocess: the launcher starts rank 1 by running it again), vLLM in
    each, tensor-parallel over both, every sync from the live tensors (no file). Every rank
    samples the step's whole batch with the same prompts and trains on its half: on policy
    (rollouts tagged with the step pushed last), the run ends, and the reward climbs as the
    one-process recipe's does over the same steps (same seeds, same update)."""
    import psutil

    steps, window = 30, 10  # the reward leaves its start (~0.002) within 30 steps
    ranks_dir, default_dir = tmp_path / "ranks", tmp_path / "default"
    ranks_dir.mkdir()
    default_dir.mkdir()
    config = _config(ranks_dir, steps, "ranks.yaml")
    moved = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in (*moved, "WEIGHT_BRIDGE_SYNC")}
    command = [sys.executable, str(RECIPE / "train.py"), "fit", "--config", str(config)]
    done = subprocess.run(
        command, cwd=ranks_dir, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in done.stdout + done.stderr
    left = []  # the run ends: no rank of it left behind
    for proc in psutil.process_iter(["cmdline"]):
        if str(config) in " ".join(proc.info["cmdline"] or []):
            left.append(proc)
    assert not psutil.wait_procs(left, timeout=30)[1]

    run = ranks_dir / "run"
    summary = json.loads((run / "summary.json").read_text())
    cfg = yaml.safe_load(config.read_text())["model"]
    tokens = steps * cfg["prompts_per_step"] * cfg["group_size"] * cfg["max_new_tokens"]
    assert summary["steps"] == steps
    # Every rollout of step N was sampled by the weights pushed at step N: the whole batch's.
    assert summary["staleness_max"] == 0 and summary["staleness_tokens"] == {"0": tokens}
    rows = [r for r in _metrics(run) if "reward" in r]  # the recipe's, one a step
    assert [r["step"] for r in rows] == list(range(steps))
    assert [r["policy_version"] for r in rows] == list(range(steps))
    assert summary["logprob_gap_max"] < 1e-3  # the TP=2 engine computes what the trainer does
    pushes = [r for r in _metrics(run) if "weight_sync/version" in r]  # the callback's
    assert [r["weight_sync/version"] for r in pushes] == list(range(steps + 1))
    assert summary["last_checkpoint"] == "" and not (run / "checkpoints").exists()  # no file

    cli, _ = _fit(monkeypatch, default_dir, steps)  # the default recipe, one process
    ranks = [r["reward"] for r in rows]
    default = [h["reward"] for h in cli.model.history]
    first, last = sum(ranks[:window]) / window, sum(ranks[-window:]) / window
    assert last > 5 * first, ranks  # it learns
    reference = sum(default[-window:]) / window
    assert 0.5 * reference <= last <= 2 * reference, (ranks, default)
