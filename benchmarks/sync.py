"""Benchmark section "sync end to end": the callback's sync in a real Lightning Trainer.

    python -m benchmarks --only sync --out bench/results.json   # this section alone, merged
                                                                # into the JSON under "sync"

For each size (the 100M Llama, fp32, untied, and SmolLM2-135M-Instruct, the real model), a
``LightningModule`` holding the Hugging Face model (fp32, AdamW) is trained for ``reps`` steps
with :class:`~callbacks.VLLMWeightSync` syncing after every optimizer step (and once at train
start: the first sync is excluded, it pays the first-touch costs). Per variant, the callback's
own ``save_s`` (plan, gather, write, rename) and ``push_s`` (the engine's push) of every sync,
median and spread, against the two-memory-copies limit: ``2 x`` a ``copy_`` of the model's
tensors into preallocated tensors (trainer -> transport, transport -> engine), timed in the same
process right before each sync; the ratio is taken per sync (so both sides see the same load on
a shared machine), its median reported.

Variants: ``default`` (``VLLMWeightSync(engine=EngineSpec(model=...))`` with every default: the
engine built by the callback, vLLM's default multi-process engine (engine core and worker in
processes of their own, as a user gets it), the transport in ``/dev/shm``, the previous file's
pages recycled, no fsync, no content hash, the push's split jobs on the CPU vLLM leaves spare);
then each lever on its own, on an engine started once per filesystem and handed to the callback:
``no_recycle`` (a new file every sync), ``no_kept_maps`` (the spare's pages recycled, but
written with ``write()``, not through the map the writer keeps of each file), ``writer_hash``
(the hash in the file, not checked by the engine), ``no_spare_cpus`` (an engine whose worker
pushes on its own CPU only: ``WEIGHT_BRIDGE_PUSH_THREADS=0``), ``disk`` (``ram_dir=False``: the
log directory, not fsynced), ``durable`` (the log directory, fsynced: ``durable=True``),
``verify_hash`` (an engine that verifies hashes: the writer hashes, the engine checks), and
``old_defaults`` (every setting the callback had before: disk, fsync, hashes verified,
``keep_last_k=2``). Memory, in one more sync after the timed ones (the samplers' wake-ups
every 2 ms would compete with the push for the machine's CPUs): the trainer process's peak extra
resident memory (``VmHWM`` reset before, which counts mapped ``/dev/shm`` pages too) and the
peak bytes of the sync directory's files (sampled), the RAM the transport holds.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .machine import CpuLoad, RssSampler, fs_type
from .per_size import reps_child_main, run_sizes
from .stats import stats

__all__ = ["SYNC_SIZES", "bench_sync", "render_sync"]

SYNC_SIZES = ("100m", "smollm2")
TARGET_X = 6.0  # default sync (save + push) within 6x the two-copy limit


def model_dir_of(workdir: Path, size: str) -> Path:
    from weight_bridge.testing.models import build_tiny_model
    from weight_bridge.testing.real_model import real_model_dir

    if size == "smollm2":
        return real_model_dir()
    return build_tiny_model(
        workdir / f"sync_{size}", arch="llama", size=size, seed=0, tie_word_embeddings=False
    )


def _module(model_dir: Path, lr: float = 1e-4) -> Any:
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
            data = torch.randint(4, 500, (64, 8), generator=g)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=1)

    return Policy()


class _DirSampler:
    """Peak bytes held by the files of a directory (allocated blocks), sampled in a thread."""

    def __init__(self, directory: Path, interval: float = 0.002) -> None:
        self.directory = directory
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def held(self) -> int:
        total = 0
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.directory):
                with contextlib.suppress(OSError):
                    total += entry.stat(follow_symlinks=False).st_blocks * 512
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.held())
            time.sleep(self.interval)

    def __enter__(self) -> _DirSampler:
        self.peak = self.held()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.held())


class _Copier:
    """Two memory copies of the model, timed right before each sync (the load on a shared
    machine changes by the second): ``copy_`` of every tensor the checkpoint holds (tied ones
    once) into tensors preallocated and touched once, twice over; the best of three."""

    def __init__(self) -> None:
        self.pairs: list[tuple[Any, Any]] = []
        self.bytes = 0

    def __call__(self, module: Any) -> float:
        import torch

        if not self.pairs:
            seen: set[int] = set()
            for t in module.model.state_dict().values():
                ptr = t.untyped_storage().data_ptr()
                if ptr not in seen:
                    seen.add(ptr)
                    dst = torch.empty_like(t)
                    dst.copy_(t)  # first touch outside the timing
                    self.pairs.append((dst, t.detach()))
            self.bytes = sum(t.nbytes for _, t in self.pairs)
        best = float("inf")
        for _ in range(3):  # the best of three: the machine's bandwidth at this moment
            t0 = time.perf_counter()
            for _ in range(2):
                for dst, src in self.pairs:
                    dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
        return best


def _measured_sync(memory_step: int, **kwargs: Any) -> Any:
    from callbacks import VLLMWeightSync

    class MeasuredSync(VLLMWeightSync):
        """The callback, each sync right after a timing of two memory copies of the model;
        the sync of ``memory_step`` (not timed) inside a memory sampler of this process and
        its directory."""

        def __init__(self, tweak: Callable[[Any], None] | None = None, **kw: Any) -> None:
            super().__init__(**kw)
            self.two_copies: list[float] = []
            self.memory: dict[str, Any] = {}
            self.copier = _Copier()
            self.tweak = tweak

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            super().setup(trainer, pl_module, stage)
            if self.tweak is not None:  # a lever the callback has no option for
                self.tweak(self)

        def _sync(self, trainer: Any, pl_module: Any, step: int) -> None:
            assert self._dir is not None
            if step != memory_step:
                self.two_copies.append(self.copier(pl_module))
                super()._sync(trainer, pl_module, step)
                return
            with RssSampler([os.getpid()], interval=0.002) as rss, _DirSampler(self._dir) as d:
                super()._sync(trainer, pl_module, step)
            self.memory = {
                "step": step,
                "dir_peak_bytes": d.peak,
                "dir_after_bytes": d.held(),
                **rss.report(),
            }

    return MeasuredSync(**kwargs)


def fit_measured(
    model_dir: Path,
    root: Path,
    reps: int,
    lr: float = 1e-4,
    delta: str = "auto",
    **sync_kwargs: Any,
) -> tuple[Any, Any]:
    """A real Trainer (AdamW at ``lr``) with the measured callback (``delta``, the rest of
    ``sync_kwargs``) syncing after every step; the callback and the module."""
    import lightning.pytorch as pl

    from callbacks import Schedule

    # syncs: at train start (first-touch costs, not counted), after steps 1..reps (timed),
    # after step reps + 1 (memory sampled)
    schedule = Schedule(every_n_train_steps=1, delta=delta)
    sync = _measured_sync(reps + 1, schedule=schedule, **sync_kwargs)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=reps + 1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        callbacks=[sync],
    )
    module = _module(model_dir, lr)
    trainer.fit(module)
    return sync, module


def free_memory() -> None:
    """Drop what a finished run left (its model, optimizer state, copies): hand it back."""
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def summarise(sync: Any) -> dict[str, Any]:
    """A measured run's syncs: times against the two-copy limit, memory, each kind sent."""
    # the first sync pays first-touch costs; the last one ran with the memory samplers
    steady = [h for h in sync.history[1:] if h["step"] != sync.memory.get("step")]
    save = [h["save_s"] for h in steady]
    push = [h["push_s"] for h in steady]
    total = [h["save_s"] + h["push_s"] for h in steady]
    mem = sync.memory
    sync.copier.pairs.clear()  # the copies and the model they reference go with the run
    limits = sync.two_copies[1:]
    paired = [t / limit for t, limit in zip(total, limits, strict=True)]
    return {
        "syncs": len(sync.history),
        "dir": str(sync._dir),
        "fs": fs_type(sync._dir) if sync._dir is not None else None,
        "in_ram": sync._in_ram,
        "durable": sync.files.durable,
        "verify_hash": getattr(sync.engine, "verify_hash", False) is True,
        "save_s": stats(save),
        "push_s": stats(push),
        "sync_s": stats(total),
        "two_copies_s": stats(limits),
        "x_two_copies": statistics.median(paired) if paired else None,
        "x_two_copies_per_sync": paired,
        "bytes": sync.copier.bytes,
        "first_sync_s": sync.history[0]["save_s"] + sync.history[0]["push_s"],
        "peak_rss_extra_bytes": mem.get("hwm_extra_total") or 0 if mem else None,
        "peak_anon_extra_bytes": mem.get("peak_extra_anon"),
        "peak_dir_bytes": mem.get("dir_peak_bytes"),
        "dir_after_bytes": mem.get("dir_after_bytes"),
        "deltas": [h["delta"] for h in sync.history],
        "choices": [h["choice"].get("why") for h in sync.history],
    }


def _writer_levers(model_dir: Path, directory: Path, reps: int) -> dict[str, Any]:
    """The writer alone on the model's tensors (fp32), files in ``directory``, round-robin:
    a new file or the spare's pages (written, or through the map kept of it), with or without
    the hash, and a cast to bf16 in the writer's one pass against a cast of each whole tensor
    before writing it (as before)."""
    import torch

    from weight_bridge.checkpoint import CheckpointReader, CheckpointWriter
    from weight_bridge.checkpoint.mapping import TransportMaps

    from .stats import Rounds

    files = sorted(model_dir.glob("*.safetensors"))
    with CheckpointReader(files[0]) as reader:
        tensors = {n: t.clone() for n, t in reader.tensors()}
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    spare = directory / ".spare"
    target = directory / "w.safetensors"
    maps = TransportMaps()

    def write(hashed: bool, reuse: bool, cast: str | None, mapped: bool = False) -> float:
        dtype = torch.bfloat16 if cast else None
        specs = {
            n: torch.empty(t.shape, dtype=dtype or t.dtype, device="meta")
            for n, t in tensors.items()
        }
        t0 = time.perf_counter()
        kept = maps if mapped else None
        with CheckpointWriter(
            target, specs, None, False, hashed, spare if reuse else None, kept
        ) as w:
            for n, t in tensors.items():
                if cast == "before":
                    w.write(n, t.to(torch.bfloat16))
                else:
                    w.write(n, t, cast=cast == "writer")
            w.finish()
        elapsed = time.perf_counter() - t0
        if reuse:
            os.rename(target, spare)
        else:
            target.unlink()
        return elapsed

    methods = {
        "new_file": lambda rep: write(False, False, None),
        "new_file_hashed": lambda rep: write(True, False, None),
        "recycled": lambda rep: write(False, True, None),
        "recycled_hashed": lambda rep: write(True, True, None),
        "recycled_mapped": lambda rep: write(False, True, None, mapped=True),
        "bf16_cast_in_writer": lambda rep: write(False, False, "writer"),
        "bf16_cast_before": lambda rep: write(False, False, "before"),
    }
    rounds = Rounds()
    rounds.run(methods, max(reps, 3))
    maps.close()
    shutil.rmtree(directory, ignore_errors=True)
    out: dict[str, Any] = {
        "dir_fs": fs_type(directory.parent),
        "bytes": sum(t.nbytes for t in tensors.values()),
    }
    for name in methods:
        out[name] = rounds.result(name)
    return out


def _bench_size(
    size: str, workdir: Path, reps: int, shm: Path, log: Callable[[str], None]
) -> dict[str, Any]:
    from callbacks import CheckpointFiles, EngineSpec
    from weight_bridge.vllm.clients.launch import engine_environment
    from weight_bridge.vllm.worker.cpu_threads import PUSH_THREADS_ENV

    from .config import ENGINE_KWARGS

    model_dir = model_dir_of(workdir, size)
    out: dict[str, Any] = {"size": size, "model_dir": str(model_dir), "variants": {}}
    log(f"{size}: default (the callback builds its engine)")
    sync, module = fit_measured(
        model_dir, workdir / f"run_{size}_default", reps,
        engine=EngineSpec(model=str(model_dir), args=dict(ENGINE_KWARGS)),
    )  # fmt: skip
    out["variants"]["default"] = summarise(sync)
    del module, sync
    free_memory()
    log(f"{size}: the writer alone")
    out["writer"] = _writer_levers(model_dir, shm / f"writer-{size}", reps)
    from weight_bridge.vllm import ColocatedEngine

    ram_root = shm / f"sync-{size}"
    disk_root = workdir / f"disk-{size}"
    for d in (ram_root, disk_root):
        d.mkdir(parents=True, exist_ok=True, mode=0o700)

    def no_recycle(sync: Any) -> None:
        sync.gatherer.spare = None  # a new file every sync: fresh tmpfs pages

    def no_kept_maps(sync: Any) -> None:
        sync.gatherer.maps = None  # the spare's pages recycled, written with write()

    def writer_hash(sync: Any) -> None:
        sync.gatherer.hashed = True  # the hash in the file, not checked by the engine

    no_helpers = {PUSH_THREADS_ENV: "0"}  # the worker's push on its own CPU only
    levers: list[tuple[str, Path, dict[str, str], dict[str, Any]]] = [
        ("no_recycle", ram_root, {}, {"tweak": no_recycle}),
        ("no_kept_maps", ram_root, {}, {"tweak": no_kept_maps}),
        ("writer_hash", ram_root, {}, {"tweak": writer_hash}),
        ("verify_hash", ram_root, {}, {"verify": True}),
        ("no_spare_cpus", ram_root, no_helpers, {}),
        ("disk", disk_root, {}, {"files": CheckpointFiles(ram_dir=False)}),
        ("durable", disk_root, {}, {"files": CheckpointFiles(durable=True)}),
        (
            "old_defaults",
            disk_root,
            {},
            {"files": CheckpointFiles(durable=True, keep_last_k=2), "verify": True},
        ),
    ]
    engines: dict[tuple, Any] = {}
    try:
        for name, root, env, kwargs in levers:
            key = (root, tuple(sorted(env.items())))
            if key not in engines:
                for other in engines.values():  # one engine at a time: memory is shared
                    other.close()
                engines.clear()
                free_memory()
                log(f"{size}: engine with its checkpoint root in {fs_type(root)} ({root}) {env}")
                with engine_environment((), env):  # its processes read it when they start
                    engines[key] = ColocatedEngine(
                        str(model_dir), checkpoint_root=str(root), **ENGINE_KWARGS
                    )
            log(f"{size}: {name}")
            verify = kwargs.pop("verify", False)  # the engine verifies every push's hash
            engines[key].verify_hash = verify
            sync = fit_measured(model_dir, root, reps, engine=engines[key], **kwargs)[0]
            engines[key].verify_hash = False
            out["variants"][name] = summarise(sync)
            del sync
            free_memory()
    finally:
        for engine in engines.values():
            engine.close()
        shutil.rmtree(ram_root, ignore_errors=True)
        shutil.rmtree(disk_root, ignore_errors=True)
    default = out["variants"]["default"]
    out["bytes"] = default["bytes"]
    out["two_copy_limit_s"] = default["two_copies_s"]["median"]
    out["target"] = {
        "what": f"default sync (save_s + push_s) / two memory copies of the model timed right "
        f"before it, median over the syncs after the first, <= {TARGET_X}",
        "value": TARGET_X,
        "x": default["x_two_copies"],
        "met": default["x_two_copies"] is not None and default["x_two_copies"] <= TARGET_X,
    }
    return out


def bench_sync(
    workdir: Path, sizes: list[str], reps: int, shm: Path, log: Callable[[str], None]
) -> dict[str, Any]:
    """The "sync end to end" section: every size, every variant (see the module docstring),
    each size in a process of its own (what a run leaves allocated goes with it)."""
    load = CpuLoad()
    result: dict[str, Any] = {
        "what": __doc__.split("\n\n")[2].replace("\n", " ") if __doc__ else "",
        "reps": reps,
        "sizes": {},
    }
    result["sizes"] = run_sizes("benchmarks.sync", sizes, ["--reps", str(reps)], workdir, shm, log)
    result["load"] = load.report()
    return result


def main(argv: list[str] | None = None) -> int:
    """One size of the section (what :func:`bench_sync` runs in a child)."""
    return reps_child_main("benchmarks.sync", argv, _bench_size)


def render_sync(section: dict[str, Any]) -> str:
    """The section as a markdown table."""
    lines = [
        "## Sync end to end (real Trainer, AdamW, every step)",
        "",
        "| size | variant | dir | save s | push s | save+push s | x two copies | peak RSS+ MiB "
        "| peak dir MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for size, s in section.get("sizes", {}).items():
        if "error" in s:
            lines.append(f"| {size} | error: {s['error']} | | | | | | | |")
            continue
        mib = s["bytes"] / 2**20
        limit = s["two_copy_limit_s"]
        lines.append(
            f"| {size} ({mib:.0f} MiB) | two-copy limit | memory | | | {limit:.3f} | 1.0 | | |"
        )
        for name, v in s["variants"].items():
            rss = (v["peak_rss_extra_bytes"] or 0) / 2**20
            held = (v["peak_dir_bytes"] or 0) / 2**20
            lines.append(
                f"| {size} | {name} | {v['fs']} | {v['save_s']['median']:.3f} "
                f"| {v['push_s']['median']:.3f} | {v['sync_s']['median']:.3f} "
                f"| {v['x_two_copies']:.1f} | {rss:.0f} | {held:.0f} |"
            )
    for size, s in section.get("sizes", {}).items():
        w = s.get("writer")
        if not w or "new_file" not in w:
            continue
        cells = " | ".join(
            f"{k} {w[k]['median']:.3f}" for k in w if isinstance(w[k], dict) and "median" in w[k]
        )
        lines.append(f"\nWriter alone, {size}, {w['dir_fs']}, median s: {cells}")
    load = section.get("load", {})
    lines += ["", f"Load during the section: {load}", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
