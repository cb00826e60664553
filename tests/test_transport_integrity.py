"""The transport never serves the wrong bytes and never grows (issue 37).

One adversarial test per hazard, each judged against a stock vLLM cold start on the checkpoint
that should be served:

* a new run reusing ``dirpath`` replaces the names of a live chain, then a push fails after
  writing: the rollback re-reads the *held* files, not the new ones under the old names;
* a second engine holds a file the trainer's writer would recycle: the writer must not write
  into it (multi-process engines, in a script of their own);
* a refusal on one tensor-parallel rank: no rank wrote, so no rank rolls back (TP=2, a script);
* 200 syncs (deltas, as by default) with frozen embeddings, with LoRA merged and training only
  the embeddings: after every sync the files and bytes the transport holds (directory and
  descriptors) stay within what the keyframes and the delta budget allow;
* a run killed with SIGKILL leaves its RAM directory, which the next start removes; SIGTERM
  removes it at once.

FAULT INJECTION: the fault after writing wraps a weight loader (``helpers.arm_write_fault``),
the one-rank refusal corrupts one rank's recorded layout of one tensor: neither can be caused
from outside on a healthy machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    ENGINE_KWARGS,
    TESTS,
    TinyLM,
    arm_write_fault,
    assert_parity,
    greedy,
    model_dir_with,
    run_script,
    trainer,
)

from callbacks import CheckpointFiles, EngineSpec, Schedule, VLLMWeightSync
from weight_bridge.checkpoint import CheckpointReader
from weight_bridge.delta.keyframes import DELTA_EVERY_K
from weight_bridge.direct import DirectReloadError

SHM = Path("/dev/shm")
FROZEN = ("model.embed_tokens.",)


def _tensors(path: str | Path) -> dict[str, torch.Tensor]:
    with CheckpointReader(path) as reader:
        return {name: t.clone() for name, t in reader.tensors()}


def _trained_dir(module, config_dir: Path, dst: Path) -> Path:
    """The trainer's weights as a model directory a cold start loads (LoRA merged)."""
    import copy

    model = module.model
    if hasattr(model, "merge_and_unload"):
        model = copy.deepcopy(model).merge_and_unload()
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    return model_dir_with(config_dir, state, dst)


# -- a new run reusing dirpath --------------------------------------------------------------


def test_a_run_reusing_dirpath_cannot_change_what_a_rollback_re_reads(
    models, shared_engine, stock_cold, tmp_path
) -> None:
    """Run 1 leaves the engine on a chain (a complete step-0, a partial on top). Run 2 writes
    its own step-0 under the same name, and its push fails after writing: the engine rolls
    back to run 1's chain as it was served (re-read through the descriptors it holds), and
    equals a cold start on run 1's weights. Re-read by name, the base would be run 2's."""
    a = models["llama_A"]
    engine = shared_engine("llama_A")
    files = CheckpointFiles(dirpath=str(tmp_path / "ws"))
    first = TinyLM(str(a), lr=0.05)
    first.model.model.embed_tokens.weight.requires_grad_(False)
    sync = VLLMWeightSync(engine=engine, files=files, schedule=Schedule(every_n_train_steps=2))
    trainer(tmp_path / "run1", [sync], max_steps=2).fit(first)
    assert [(h["step"], h["partial"]) for h in sync.history] == [(0, False), (2, True)]
    expected = _trained_dir(first, a, tmp_path / "run1-weights")

    second = TinyLM(str(models["llama_B"]))
    rerun = VLLMWeightSync(engine=engine, files=files)
    engine.llm.collective_rpc(arm_write_fault)  # run 2's first push fails after writing
    with pytest.raises(DirectReloadError, match="rolled back to version '2'"):
        trainer(tmp_path / "run2", [rerun], max_steps=1).fit(second)
    assert str(engine.version) == "2" and engine.undefined is None
    assert _tensors(tmp_path / "ws" / "step-00000000.safetensors")["lm_head.weight"].equal(
        second.model.lm_head.weight.detach()
    )  # the name now holds run 2's weights
    assert_parity(greedy(engine), stock_cold(expected))
    engine.push(a, version="A")


def test_a_served_file_changed_in_place_is_refused_by_name_not_rolled_back_onto(
    models, shared_engine, tmp_path
) -> None:
    """A program that ignores the engine's lock rewrites bytes of the served file in place;
    the next push fails after writing. Re-read, the file would be finite, well-shaped and
    wrong: the identity check refuses it, the engine is *undefined* naming the file and what
    changed, and a complete push repairs it."""
    a, b = models["llama_A"], models["llama_B"]
    engine = shared_engine("llama_A")
    served = tmp_path / "served.safetensors"
    shutil.copy(a / "model.safetensors", served)
    engine.push(served, version="A")
    with open(served, "r+b") as f:  # a foreign writer: the last 4 bytes of the data, in place
        f.seek(-4, os.SEEK_END)
        f.write(b"\x00\x00\x80\x3f")
    engine.llm.collective_rpc(arm_write_fault)
    with pytest.raises(DirectReloadError, match="changed since the engine took it"):
        engine.push(b, version="B")
    assert engine.undefined is not None and str(served) in engine.undefined
    assert "modification time" in engine.undefined
    engine.push(a, version="A")  # a complete push repairs it
    assert engine.undefined is None and engine.version == "A"


# -- 200 syncs: the transport stays bounded ---------------------------------------------------


def _held(directory: Path) -> tuple[int, int]:
    """Files and bytes (RAM pages allocated) the transport holds: those in its directory, and
    those deleted from it that a descriptor of this process (the in-process engine) keeps."""
    paths = {p.resolve() for p in directory.iterdir() if p.is_file() and p.name != ".owner"}
    sizes = {p: p.stat().st_blocks * 512 for p in paths}
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(str(directory)) and target.endswith(" (deleted)"):
            sizes[Path(target)] = os.stat(fd).st_blocks * 512
    return len(sizes), sum(sizes.values())


class _Counter:
    """After every sync: the files and bytes the transport holds, and the engine's chain."""

    def __init__(self, sync: VLLMWeightSync, engine) -> None:
        self.sync, self.engine = sync, engine
        self.at: dict[int, tuple[int, int, list[str]]] = {}

    def __call__(self) -> None:
        n = len(self.sync.history)
        if n not in self.at:
            assert self.sync._dir is not None
            self.at[n] = (*_held(self.sync._dir), list(self.engine.served_checkpoints))


def _counting(counter: _Counter):
    import lightning.pytorch as pl

    class Count(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            counter()

    return Count()


# A file's RAM pages beyond the tensor bytes its sync reports: its header (under 4 KiB for this
# model, fingerprints included) and the rest of its last page.
FILE_SLACK = 2 * 4096


def _assert_bounded(history: list[dict], held: tuple[int, int, list[str]], budget: float) -> int:
    """The transport after ``history``, against what the schedule allows. The served chain is
    the newest complete sync, then later syncs only, in order: a keyframe at most (a partial
    one) and the deltas since, which add up to no more than ``budget`` x the keyframe's bytes
    plus the one that passed it. Beside the chain the transport holds one spare at most (a
    file for the next write, no engine serves it): at most ``DELTA_EVERY_K + 1`` files, and in
    bytes the chain's and the spare's. Returns the chain's length."""
    files, nbytes, chain = held
    paths = [h["checkpoint"] for h in history]
    size = {h["checkpoint"]: h["bytes"] for h in history}
    kind = {h["checkpoint"]: "d" if h["delta"] else "p" if h["partial"] else "c" for h in history}
    last = max(i for i, p in enumerate(paths) if kind[p] == "c")
    assert chain[0] == paths[last] and chain[-1] == paths[-1], chain
    assert chain == [p for p in paths[last:] if p in chain], chain  # only since, in order
    keyframe = max(i for i, p in enumerate(chain) if kind[p] != "d")
    assert keyframe <= 1, chain  # the complete one, or a partial one on it
    deltas = [size[p] for p in chain[keyframe + 1 :]]
    assert all(kind[p] == "d" for p in chain[keyframe + 1 :]), chain
    assert sum(deltas[:-1]) <= budget * size[chain[keyframe]], (chain, deltas)
    assert files <= len(chain) + 1 <= DELTA_EVERY_K + 1, (files, chain)
    spare = max(size.values())  # made the size of a file written, or a former file
    allowed = sum(size[p] for p in chain) + spare + files * FILE_SLACK
    assert nbytes <= allowed, (nbytes, allowed, chain)
    return len(chain)


@pytest.mark.slow
@pytest.mark.parametrize("trained", ["frozen-embeddings", "lora", "embeddings-only"])
def test_two_hundred_syncs_hold_a_bounded_chain(
    trained, models, shared_engine, stock_cold, tmp_path
) -> None:
    """The callback with its defaults but ``delta="on"`` (``"auto"`` sends none through host
    memory), the RAM transport (the engine reads ``/dev/shm``). After the first (complete) sync
    the engine reports its dtypes and syncs become deltas: a
    partial keyframe once the deltas pass ``DELTA_BUDGET`` of the last keyframe, a complete one
    every ``DELTA_EVERY_K``. A delta's sparse tensors cover nothing, so a chain of sparse
    deltas is kept whole down to its keyframe (training only the embeddings moves a few rows a
    step: sparse deltas, a chain of dozens); dense ones (frozen embeddings, LoRA merged: every
    trained element moves) cover the links below them. After every one of 200 syncs the files
    and bytes held stay within :func:`_assert_bounded`'s bound (at most ``DELTA_EVERY_K + 1``
    files; the chain's bytes and a spare's), each complete keyframe cuts the chain back to one
    file, and at the end the engine equals a cold start on the trainer's weights."""
    a = models["llama_A"]
    engine = shared_engine("llama_A", checkpoint_root=str(SHM))
    module = TinyLM(str(a), lr=0.01)
    if trained == "lora":
        import peft

        config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
        module.model = peft.get_peft_model(module.model, config)
    else:
        for name, p in module.model.named_parameters():
            p.requires_grad_(name.startswith(FROZEN) == (trained == "embeddings-only"))
    sync = VLLMWeightSync(engine=engine, schedule=Schedule(every_n_train_steps=1, delta="on"))
    counter = _Counter(sync, engine)
    fit = trainer(tmp_path, [sync, _counting(counter)], max_steps=199)
    fit.fit(module)
    history, budget = sync.history, sync.clock.delta_budget
    assert len(history) == 200 and sync.schedule.delta == "on"
    assert sync._dir is not None and str(sync._dir).startswith(str(SHM))
    lengths = {n: _assert_bounded(history[:n], counter.at[n], budget) for n in counter.at}
    assert len(lengths) == 199  # after every sync but the first (at train start)
    completes = [i for i, h in enumerate(history) if not h["partial"] and not h["delta"]]
    assert completes == list(range(0, 200, DELTA_EVERY_K))
    assert all(lengths[i + 1] == 1 for i in completes[1:])  # each cuts the chain to one file
    assert sum(h["delta"] for h in history) > 100  # deltas ran
    if trained == "embeddings-only":  # sparse deltas: a long chain, bounded all the same
        assert max(lengths.values()) > 10, lengths
    assert_parity(greedy(engine), stock_cold(_trained_dir(module, a, tmp_path / "trained")))
    # released at teardown but for the files the engine (not the callback's) still serves
    assert {p.name for p in sync._dir.glob("step-*")} == {
        Path(p).name for p in engine.served_checkpoints
    }
    shutil.rmtree(sync._dir)


# -- a second engine on the same files ---------------------------------------------------------


TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1"}


def _transport_check(*args: str, env: dict | None = None) -> dict:
    # Only so that the fault-injecting callables can be sent to the worker processes.
    env = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1", **(env or {})}
    return run_script("test_transport_integrity.py", *args, env=env)[0]


def second_engine_scenario(model: str, out: str) -> dict:
    """The callback's engine and an eval engine pushed from ``last_checkpoint`` at step 1; at
    step 3 the eval engine's push fails after writing and rolls back onto step 1's file."""
    import lightning.pytorch as pl

    from weight_bridge import ColocatedEngine

    kwargs = dict(ENGINE_KWARGS, checkpoint_root=str(SHM))
    result: dict = {}
    with ColocatedEngine(model, **kwargs) as own, ColocatedEngine(model, **kwargs) as other:
        # Partial syncs: the callback's engine lets go of step 1's file at step 2, so only the
        # eval engine holds it (a delta chain would keep it served), and step 3's file is a
        # whole partial the eval engine can take on step 1 (a delta's base is step 2).
        every_step = Schedule(every_n_train_steps=1, delta="off")
        sync = VLLMWeightSync(engine=own, schedule=every_step)

        class Eval(pl.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                step, path = trainer.global_step, sync.history[-1]["checkpoint"]
                assert path is not None
                if step == 1:
                    other.push(path, version="1")
                    shutil.copy(path, Path(out) / "step-1.safetensors")
                elif step == 3:
                    other.llm.collective_rpc(arm_write_fault)
                    try:
                        other.push(path, version="3")
                    except Exception as exc:
                        result["error"] = str(exc)
                    result["version"] = other.version
                    result["greedy"] = greedy(other)
                    result["held_by_eval"] = list(other.served_checkpoints)

        module = TinyLM(model, lr=0.05)
        trainer(Path(out), [sync, Eval()], max_steps=3).fit(module)
        result["dir_in_ram"] = str(sync._dir).startswith(str(SHM))
    return result


@pytest.mark.slow
def test_a_file_another_engine_holds_is_never_recycled(models, stock_cold, tmp_path) -> None:
    a = models["llama_A"]
    r = _transport_check("second-engine", str(a), str(tmp_path))
    assert r["dir_in_ram"] and "rolled back to version '1'" in r["error"], r.get("error")
    assert r["version"] == "1"
    step1 = model_dir_with(a, _tensors(tmp_path / "step-1.safetensors"), tmp_path / "cold-1")
    assert_parity(r["greedy"], stock_cold(step1))


# -- a refusal on one tensor-parallel rank -----------------------------------------------------


def refuse_on_rank_one(worker) -> int:
    """FAULT INJECTION: rank 1's recorded layout says ``model.norm.weight`` has one element,
    so rank 1 alone refuses the next checkpoint (in its first phase)."""
    from weight_bridge.direct.state import bridge_state
    from weight_bridge.layout import TensorSpec

    if worker.rank != 1:
        return worker.rank
    layout = bridge_state(worker.model_runner.get_model()).layout
    spec = layout.checkpoint["model.norm.weight"]
    layout.checkpoint["model.norm.weight"] = TensorSpec((1,), spec.dtype)
    return worker.rank


def tp_refusal_scenario(model_a: str, model_b: str) -> dict:
    from weight_bridge import ColocatedEngine

    kwargs = dict(ENGINE_KWARGS, tensor_parallel_size=2)
    result: dict = {}
    with ColocatedEngine(model_a, **kwargs) as engine:
        engine.push(Path(model_a) / "model.safetensors", version="A")
        result["ranks"] = engine.llm.collective_rpc(refuse_on_rank_one)
        try:
            engine.push(model_b, version="B")
        except Exception as exc:
            result["error"] = str(exc)
            result["problems"] = getattr(exc, "problems", None)
        result["rollback_s"] = engine.last_rollback_s
        result["version"] = engine.version
        result["greedy"] = greedy(engine)
    return result


@pytest.mark.slow
def test_a_refusal_on_one_rank_rewrites_no_rank(models, tmp_path) -> None:
    """Rank 1 refuses in the first phase: rank 0 prepared, wrote nothing, and must not roll
    back (a rollback rewrites its whole chain from files). The engine equals a TP=2 cold start
    on A."""
    from helpers import run_engine_check

    a, b = models["llama_A"], models["llama_B"]
    r = _transport_check("tp-refusal", str(a), str(b), env=TP_ENV)
    assert r["ranks"] == [0, 1]
    assert "model.norm.weight" in (r["problems"] or {}), r.get("error")
    assert "rolled back" not in r["error"] and r["rollback_s"] is None, r["error"]
    assert r["version"] == "A"
    cold = run_engine_check("cold", str(a), "--tp", "2", env=TP_ENV)["cold"]
    assert_parity(r["greedy"], cold)


# -- a killed run's RAM ------------------------------------------------------------------------


def _ram_run(steps: int, announce: bool):
    """A real ``Trainer`` and the callback in RAM (``ram_dir=True``), training a one-layer
    module, ``announce``: printing the transport directory, then training slowly. Its engine
    is a client of no server: no sync is due, only the directory's lifetime is tested."""
    import lightning.pytorch as pl

    class NoSync(VLLMWeightSync):  # only the directory's lifetime is tested: no sync runs
        def _sync(self, trainer, pl_module, step) -> None:
            pass

    never = Schedule(every_n_train_steps=None)
    spec = EngineSpec(url="http://127.0.0.1:9")
    sync = NoSync(engine=spec, files=CheckpointFiles(ram_dir=True), schedule=never)

    class Slow(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = torch.nn.Linear(2, 2)

        def training_step(self, batch, batch_idx):
            if announce:
                if batch_idx == 0:
                    print("DIR " + str(sync._dir), flush=True)
                time.sleep(0.05)
            return self.model(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.ones(steps, 2), batch_size=1)
    return sync, lambda root: trainer(root, [sync], max_steps=steps).fit(Slow(), data)


def _killed_run(tmp_path: Path, sig: signal.Signals) -> Path:
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__)), "hold-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(TESTS.parent)},
        cwd=TESTS,
    )
    assert proc.stdout is not None
    directory = None
    for line in proc.stdout:
        if line.startswith("DIR "):
            directory = Path(line[4:].strip())
            break
    assert directory is not None and directory.is_dir(), proc.communicate(timeout=5)
    proc.send_signal(sig)
    proc.communicate(timeout=120)
    return directory


def test_sigterm_removes_the_run_dir_and_a_sigkilled_ones_goes_at_the_next_start(
    tmp_path,
) -> None:
    terminated = _killed_run(tmp_path / "term", signal.SIGTERM)
    assert not terminated.exists()  # Lightning raises on SIGTERM: the callback's teardown ran
    killed = _killed_run(tmp_path / "kill", signal.SIGKILL)
    assert killed.is_dir() and (killed / ".owner").exists()
    live = SHM / f"weight_bridge-{os.getpid()}-0123abcd"  # a live process's: kept
    live.mkdir()
    try:
        sync, fit = _ram_run(1, announce=False)  # the next start of the callback (same user)
        fit(tmp_path / "next")
        assert not killed.exists() and live.is_dir()
        assert sync._dir is not None and not sync._dir.exists()  # its own, removed at the end
    finally:
        shutil.rmtree(live, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1] == "hold-dir":
        _ram_run(100000, announce=True)[1](Path(sys.argv[2]))
        sys.exit(0)
    if sys.argv[1] == "second-engine":
        out = second_engine_scenario(sys.argv[2], sys.argv[3])
    else:
        out = tp_refusal_scenario(sys.argv[2], sys.argv[3])
    print("RESULT " + json.dumps(out, default=str), flush=True)
