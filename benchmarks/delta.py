"""Benchmark section "delta sync": a sync that sends only what changed, against a complete one.

    python -m benchmarks --only delta --out bench/results-delta.json   # make bench-delta

For each size (the 100M Llama, fp32, untied, and SmolLM2-135M-Instruct, tied) one bridged engine
with ``dtype="bfloat16"`` (vLLM's default multi-process engine, the benchmark's worker extension)
serves a real Lightning ``Trainer`` (the Hugging Face model in fp32, AdamW, 4 x 16 random tokens
a step) through :class:`~callbacks.VLLMWeightSync`, a sync after every optimizer step, for each
learning rate in turn, two runs side by side on the same engine:

* ``delta``: ``Schedule(delta="on", skip_frozen=False)``, ``CheckpointNames(dtype="engine")``:
  the first sync (train start) is complete in fp32 (the engine has not reported its dtypes yet),
  the second a complete bf16 keyframe, every later one a delta against it;
* ``complete``: the same with ``delta="off"``: every sync after the first a complete bf16
  checkpoint.

Per sync: the callback's ``save_s``, the push report's ``elapsed_s`` as ``push_s``, split into
*apply* (``elapsed_s - refresh_s``: preflight, write, read-back, fingerprints, RPCs) and the CPU
*re-pack* (``refresh_s``: vLLM's oneDNN re-pack of every linear written, O(model) on this CPU),
the file's bytes, and the fraction of elements changed. After every sync of a delta run the
engine's exact fingerprints (:meth:`~weight_bridge.vllm.ColocatedEngine.fingerprints`) are
compared with the trainer's current bf16 cast.

Then the delta run's files (copies of the bf16 keyframe and every delta) are replayed into the
same engine: the keyframe, then per delta vLLM's own sparse patches
(:mod:`benchmarks.delta_worker`: ``load_checkpoint_weight_patches`` in the worker, timed from
the client like the push, snapshot and restore untimed) and the bridge's push of the same file,
one after the other on the same base; the bits each leaves are compared with each other and
with the trainer's fingerprints. At the last delta the greedy tokens and top-3 logprobs of both
(four runs of the prompts each) are compared with those of a stock vLLM cold start (bf16) on
the trainer's final cast (:func:`~benchmarks.delta_checks.against_cold`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .config import ENGINE_KWARGS
from .delta_checks import (
    ENGINE_DTYPE,
    against_cold,
    cold_start,
    diff_floor,
    drift,
    replay,
    report_fields,
    samples,
    trainer_cast,
)
from .delta_report import render_delta, summarise_run
from .engines import start_engine
from .machine import CpuLoad
from .per_size import child_main, run_sizes, section_in

__all__ = [
    "DELTA_LRS",
    "DELTA_SIZES",
    "add_delta_arguments",
    "bench_delta",
    "delta_section",
    "render_delta",
]

DELTA_SIZES = ("100m", "smollm2")
DELTA_LRS = (1e-6, 1e-5)


def _model_dir(workdir: Path, size: str) -> Path:
    from weight_bridge.testing.models import build_tiny_model
    from weight_bridge.testing.real_model import real_model_dir

    if size == "smollm2":
        return real_model_dir()
    return build_tiny_model(
        workdir / f"delta_{size}", arch="llama", size=size, seed=0, tie_word_embeddings=False
    )


def _module(model_dir: Path, lr: float) -> Any:
    import lightning.pytorch as pl
    import torch

    class Policy(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            ids = batch[0]
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=lr)

        def train_dataloader(self) -> Any:
            g = torch.Generator().manual_seed(0)
            data = torch.randint(4, 500, (64, 16), generator=g)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=4)

    return Policy()


def _recording_sync(keep: Path | None, **kwargs: Any) -> Any:
    from callbacks import VLLMWeightSync

    class RecordingSync(VLLMWeightSync):
        """The callback, recording each push's report and file size; with ``keep``, a copy of
        every file after the first (the bf16 keyframe and the deltas), for the replay."""

        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            self.pushes: dict[int, dict[str, Any]] = {}
            self.kept: list[Path] = []

        def _push(self, path: Path, step: int) -> Any:
            nbytes = os.path.getsize(path)
            report = super()._push(path, step)
            self.pushes[step] = {"file_bytes": nbytes, **report_fields(report)}
            if keep is not None and step > 0:  # after the push: outside its report's time
                self.kept.append(keep / f"{len(self.kept):02d}-{Path(path).name}")
                shutil.copyfile(path, self.kept[-1])
            return report

    return RecordingSync(**kwargs)


def _drift_check(sync: Any, engine: Any) -> Any:
    from lightning.pytorch.callbacks import Callback

    class DriftCheck(Callback):
        """After each sync (the next callback in the list): the engine against the cast."""

        def __init__(self) -> None:
            self.checks: list[dict[str, Any]] = []

        def _check(self, pl_module: Any) -> None:
            if len(sync.history) > len(self.checks):
                step = sync.history[-1]["step"]
                self.checks.append({"step": step, **drift(engine, trainer_cast(pl_module))})

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self._check(pl_module)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            self._check(pl_module)

    return DriftCheck()


def _fit(model_dir: Path, root: Path, steps: int, lr: float, engine: Any, delta: bool) -> Any:
    """One run: a sync at train start and after each of ``steps`` optimizer steps."""
    import lightning.pytorch as pl

    from callbacks import CheckpointNames, Schedule

    keep = root / f"kept-{lr:g}" if delta else None
    if keep is not None:
        shutil.rmtree(keep, ignore_errors=True)
        keep.mkdir(parents=True)
    schedule = Schedule(every_n_train_steps=1, skip_frozen=False, delta="on" if delta else "off")
    names = CheckpointNames(dtype="engine")
    sync = _recording_sync(keep, engine=engine, schedule=schedule, names=names)
    callbacks = [sync] + ([_drift_check(sync, engine)] if delta else [])
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        callbacks=callbacks,
    )
    module = _module(model_dir, lr)
    trainer.fit(module)
    sync.drift = callbacks[1].checks if delta else []
    return sync, module


def _records(sync: Any) -> list[dict[str, Any]]:
    """Each sync: the callback's history entry with its push's report."""
    keys = ("step", "bytes", "delta", "changed", "save_s")
    return [{**{k: h[k] for k in keys}, **sync.pushes.get(h["step"], {})} for h in sync.history]


def _run_lr(
    model_dir: Path, root: Path, steps: int, lr: float, engine: Any, log: Callable[[str], None]
) -> dict[str, Any]:
    """The delta run, its checks and replay, then the complete run, at ``lr``."""
    log(f"  lr {lr:g}: delta run ({steps} steps)")
    sync, module = _fit(model_dir, root, steps, lr, engine, delta=True)
    out: dict[str, Any] = {"lr": lr, "delta": _records(sync), "drift": sync.drift}
    out["diff_floor_s"] = diff_floor(module)
    cast = trainer_cast(module)
    seen = {"bridge": samples(engine)}
    out["replay"] = replay(engine, sync.kept, log)
    out["replay_final"] = drift(engine, cast)
    seen["vllm_patches"] = out["replay"].pop("vllm_greedy")
    seen["bridge_after_replay"] = samples(engine)
    log("  cold start on the trainer's final cast")
    out["cold_start"] = against_cold(seen, cold_start(model_dir, cast, root / "cold"))
    del sync, module, cast
    shutil.rmtree(root / f"kept-{lr:g}", ignore_errors=True)
    log(f"  lr {lr:g}: complete run ({steps} steps)")
    sync, module = _fit(model_dir, root, steps, lr, engine, delta=False)
    out["complete"] = _records(sync)
    return summarise_run(out)


def _bench_size(
    size: str, workdir: Path, steps: int, lrs: list[float], shm: Path, log: Callable[[str], None]
) -> dict[str, Any]:
    model_dir = _model_dir(workdir, size)
    root = shm / f"delta-{size}"
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    out: dict[str, Any] = {"size": size, "model_dir": str(model_dir), "runs": {}}
    kwargs = {**ENGINE_KWARGS, "dtype": ENGINE_DTYPE}
    out["engine_kwargs"] = kwargs
    log(f"{size}: engine ({kwargs})")
    engine = start_engine(model_dir, root=root, dtype=ENGINE_DTYPE)
    try:
        for lr in lrs:
            out["runs"][f"{lr:g}"] = _run_lr(model_dir, root, steps, lr, engine, log)
    finally:
        engine.close()
        shutil.rmtree(root, ignore_errors=True)
    out["startup_s"] = engine.startup_s
    return out


def bench_delta(
    workdir: Path,
    sizes: list[str],
    lrs: list[float],
    steps: int,
    shm: Path,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """The section: every size in a process of its own (what a run leaves goes with it)."""
    load = CpuLoad()
    result: dict[str, Any] = {
        "what": __doc__.split("\n\n")[2].replace("\n", " ") if __doc__ else "",
        "engine_dtype": ENGINE_DTYPE,
        "steps": steps,
        "lrs": lrs,
        "sizes": {},
    }
    options = ["--steps", str(steps), "--lrs", ",".join(f"{lr:g}" for lr in lrs)]
    result["sizes"] = run_sizes("benchmarks.delta", sizes, options, workdir, shm, log)
    result["load"] = load.report()
    return result


def add_delta_arguments(p: Any) -> None:
    """``python -m benchmarks``'s options of this section."""
    p.add_argument(
        "--delta-sizes",
        default=",".join(DELTA_SIZES),
        help="sizes of the 'delta sync' section (benchmarks.delta; 'none': skip)",
    )
    p.add_argument(
        "--delta-lrs",
        default=",".join(f"{lr:g}" for lr in DELTA_LRS),
        help="AdamW learning rates of the 'delta sync' section",
    )
    p.add_argument(
        "--delta-steps",
        type=int,
        default=7,
        help="optimizer steps per run of 'delta sync' (a sync after each: the bf16 keyframe, "
        "then deltas)",
    )


def delta_section(args: Any, workdir: Path) -> dict[str, Any]:
    """The section from ``python -m benchmarks``'s arguments (``--delta-sizes``, ...)."""
    sizes, lrs, steps = args.delta_sizes, args.delta_lrs, args.delta_steps
    return section_in(
        workdir, "delta", lambda d, log: bench_delta(d, sizes, lrs, steps, args.shm_dir, log)
    )


def main(argv: list[str] | None = None) -> int:
    """One size of the section (what :func:`bench_delta` runs in a child)."""

    def options(p: Any) -> None:
        p.add_argument("--steps", type=int, default=7)
        p.add_argument("--lrs", default=",".join(f"{lr:g}" for lr in DELTA_LRS))

    def run(args: Any, log: Callable[[str], None]) -> dict[str, Any]:
        lrs = [float(x) for x in args.lrs.split(",")]
        return _bench_size(args.size, args.workdir, args.steps, lrs, args.shm_dir, log)

    return child_main("benchmarks.delta", argv, options, run)


if __name__ == "__main__":
    raise SystemExit(main())
