"""Sections "sync" (the callback's syncs in a real Trainer against two memory copies, by
default and each lever alone), "default" (``delta="auto"`` against complete and delta syncs)
and "fsdp" (a sync from an FSDP2 trainer against one from DDP: the writer's peak memory, torch's
full gather); the callback measured from inside, which "delta" uses too."""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from . import harness
from .harness import ENGINE_KWARGS, fs_type, line, logger, stats, trim, verdict

# fmt: off
TARGET_X = 6.0  # default sync (save + push) within 6x the two-copy limit
CASES = {"ram_fp32_lr1e-4": ("ram", "float32", 1e-4), "ram_bf16_lr1e-4": ("ram", "bfloat16", 1e-4),
         "disk_bf16_lr1e-6": ("disk", "bfloat16", 1e-6)}  # case: (where the files go, dtype, lr)
VARIANTS = {"default": "auto", "complete": "off", "delta": "on"}
ORDER = ("default", "complete", "delta", "complete", "default")  # neither gains from its place
TARGET_VS_COMPLETE, TARGET_X_TWO_COPIES = 1.1, 4.7  # the default's, on the RAM cases
FSDP_FACTOR, FSDP_FIXED = 1.2, 64 * 2**20  # the FSDP writer's peak extra memory

class DirSampler:
    """Peak bytes held by the files of a directory (allocated blocks), sampled in a thread."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.peak, self._stop = directory, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def held(self) -> int:
        total = 0
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.directory):
                with contextlib.suppress(OSError):  # renamed or removed meanwhile
                    total += entry.stat(follow_symlinks=False).st_blocks * 512
        return total

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self.held())

    def __enter__(self) -> DirSampler:
        self.peak = self.held()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.held())

class TwoCopies:
    """Two memory copies of the model into preallocated tensors, the best of three."""

    def __init__(self) -> None:
        self.pairs: list[tuple[Any, Any]] = []
        self.bytes = 0

    def __call__(self, module: Any) -> float:
        if not self.pairs:
            state = module.model.state_dict().values()
            unique = {t.untyped_storage().data_ptr(): t for t in state}
            self.pairs = [(torch.empty_like(t).copy_(t), t.detach()) for t in unique.values()]
            self.bytes = sum(t.nbytes for _, t in self.pairs)
        return min(harness.timed(lambda: [d.copy_(s) for d, s in self.pairs * 2])
                   for _ in range(3))  # the best of three: the machine's bandwidth now

def measured_sync(memory_at: int | str | None = None, record: bool = False,
                  keep: Path | None = None, tweak: Any = None, **kwargs: Any) -> Any:
    """The callback, measured on the writer: ``memory_at`` a step (that sync sampled, the
    others after two timed copies) or ``"every"``; ``record`` reports; ``keep`` files."""
    from callbacks import VLLMWeightSync
    class MeasuredSync(VLLMWeightSync):
        def __init__(self) -> None:
            super().__init__(**kwargs)
            self.two_copies, self.memory, self.pushes, self.kept = [], [], {}, []
            self.copier = TwoCopies()

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            super().setup(trainer, pl_module, stage)
            if record and self.transport.engine is not None:  # what the transport pushes into
                self.transport.engine = RecordedPushes(self.transport.engine, self, keep)
            if tweak is not None:
                tweak(self)

        def _sync(self, trainer: Any, pl_module: Any, step: int) -> None:
            if not trainer.is_global_zero or memory_at not in (step, "every"):
                if isinstance(memory_at, int):
                    self.two_copies.append(self.copier(pl_module))
                return super()._sync(trainer, pl_module, step)
            if every := memory_at == "every":
                trim()
            held = contextlib.nullcontext() if every else DirSampler(self._dir)
            with harness.RssSampler([os.getpid()], 0.001 if every else 0.002) as rss, held:
                super()._sync(trainer, pl_module, step)
            sizes = {} if every else {"dir_peak_bytes": held.peak, "dir_after_bytes": held.held()}
            self.memory.append({"step": step, **sizes, **rss.report()})

    return MeasuredSync()

class RecordedPushes:
    """An engine whose pushes ``sync`` records (the report's times; the file kept in ``keep``)."""

    def __init__(self, engine: Any, sync: Any, keep: Path | None) -> None:
        self.engine, self.sync, self.keep = engine, sync, keep

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def push(self, path: Path, version: int) -> Any:
        nbytes, report = os.path.getsize(path), self.engine.push(path, version=version)
        self.sync.pushes[version] = {"file_bytes": nbytes, **report_fields(report)}
        if self.keep is not None and version > 0:  # after the push: outside its report's time
            self.sync.kept.append(self.keep / f"{len(self.sync.kept):02d}-{Path(path).name}")
            shutil.copyfile(path, self.sync.kept[-1])
        return report

def report_fields(report: Any) -> dict[str, Any]:
    return {"push_s": report.elapsed_s, "apply_s": report.elapsed_s - report.refresh_s,
            "repack_s": report.refresh_s, "preflight_s": report.preflight_s,
            "write_s": report.write_s, "readback_s": report.readback_s,
            "elements_written": report.changed, "report_delta": report.delta}

def fit_measured(model: Path, root: Path, reps: int, lr: float = 1e-4, delta: str = "auto",
                 **sync_kwargs: Any) -> dict[str, Any]:
    """A Trainer syncing every step, ``reps`` timed, one more sampled; its syncs' summary."""
    from callbacks import Schedule
    schedule = Schedule(every_n_train_steps=1, delta=delta)
    sync = measured_sync(reps + 1, schedule=schedule, **sync_kwargs)
    harness.fit(harness.policy(model, lr), [sync], reps + 1, root)
    mem = sync.memory[-1] if sync.memory else {}
    steady = [h for h in sync.history[1:] if h["step"] != mem.get("step")]
    total, limits = [h["save_s"] + h["push_s"] for h in steady], sync.two_copies[1:]
    paired = [t / limit for t, limit in zip(total, limits, strict=True)]
    sync.copier.pairs.clear()  # the copies and the model they reference go with the run
    first, where = sync.history[0], sync._dir
    summary = {
        "syncs": len(sync.history), "dir": str(where),
        "fs": fs_type(where) if where is not None else None, "in_ram": sync._in_ram,
        "durable": sync.files.durable,
        "verify_hash": getattr(sync.engine, "verify_hash", False) is True,
        "save_s": stats(h["save_s"] for h in steady), "push_s": stats(h["push_s"] for h in steady),
        "sync_s": stats(total), "two_copies_s": stats(limits),
        "x_two_copies": statistics.median(paired) if paired else None,
        "x_two_copies_per_sync": paired, "bytes": sync.copier.bytes,
        "first_sync_s": first["save_s"] + first["push_s"],
        "peak_rss_extra_bytes": mem.get("hwm_extra_total") or 0 if mem else None,
        "peak_anon_extra_bytes": mem.get("peak_extra_anon"),
        "peak_dir_bytes": mem.get("dir_peak_bytes"), "dir_after_bytes": mem.get("dir_after_bytes"),
        "deltas": [h["delta"] for h in sync.history],
        "choices": [h["choice"].get("why") for h in sync.history]}
    del sync
    trim()  # what the run left (its model, optimizer state, copies) handed back
    return summary

def writer_levers(model: Path, directory: Path, reps: int) -> dict[str, Any]:
    """The writer alone, round-robin: a new file or the spare's pages, hashed or not, bf16."""
    from weight_bridge.checkpoint import CheckpointWriter
    from weight_bridge.checkpoint.mapping import TransportMaps
    tensors = harness.tensors_of(sorted(model.glob("*.safetensors"))[0])
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    spare, target, maps = directory / ".spare", directory / "w.safetensors", TransportMaps()

    def write(hashed: bool, reuse: bool, cast: str | None = None, mapped: bool = False) -> float:
        specs = {n: torch.empty(t.shape, dtype=torch.bfloat16 if cast else t.dtype, device="meta")
                 for n, t in tensors.items()}
        t0 = time.perf_counter()
        with CheckpointWriter(target, specs, None, False, hashed, spare if reuse else None,
                              maps if mapped else None) as w:
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
    rounds = harness.Rounds({
        "new_file": lambda rep: write(False, False),
        "new_file_hashed": lambda rep: write(True, False),
        "recycled": lambda rep: write(False, True),
        "recycled_hashed": lambda rep: write(True, True),
        "recycled_mapped": lambda rep: write(False, True, mapped=True),
        "bf16_cast_in_writer": lambda rep: write(False, False, "writer"),
        "bf16_cast_before": lambda rep: write(False, False, "before")}, max(reps, 3))
    maps.close()
    shutil.rmtree(directory, ignore_errors=True)
    nbytes = sum(t.nbytes for t in tensors.values())
    return {"dir_fs": fs_type(directory.parent), "bytes": nbytes, **rounds.results()}

def sync_size(size: str, workdir: str, reps: int, shm: str) -> dict[str, Any]:
    """One size of "sync" (a child's call): the default, the writer, each lever on its own."""
    from callbacks import CheckpointFiles, EngineSpec
    from weight_bridge import ColocatedEngine
    from weight_bridge.vllm.clients.launch import engine_environment
    from weight_bridge.vllm.worker.cpu_threads import PUSH_THREADS_ENV
    work, log, ram = Path(workdir), logger("sync"), Path(shm) / f"sync-{size}"
    disk, model = work / f"disk-{size}", harness.model_dir(work / f"sync_{size}", size)
    log(f"{size}: default (the callback builds its engine)")
    spec = EngineSpec(model=str(model), options={"engine_args": dict(ENGINE_KWARGS)})
    variants = {"default": fit_measured(model, work / f"run_{size}", reps, engine=spec)}
    log(f"{size}: the writer alone")
    out: dict[str, Any] = {"size": size, "model_dir": str(model), "variants": variants,
                           "writer": writer_levers(model, Path(shm) / f"writer-{size}", reps)}

    def gatherer(**attrs: Any) -> dict[str, Any]:  # a lever the callback has no option for
        return {"tweak": lambda sync: [setattr(sync.gatherer, k, v) for k, v in attrs.items()]}
    levers = [
        ("no_recycle", ram, {}, gatherer(spare=None)),  # a new file every sync: fresh pages
        ("no_kept_maps", ram, {}, gatherer(maps=None)),  # the spare's pages, with write()
        ("writer_hash", ram, {}, gatherer(hashed=True)),  # hashed, not checked by the engine
        ("verify_hash", ram, {}, {"verify": True}),
        ("no_spare_cpus", ram, {PUSH_THREADS_ENV: "0"}, {}),  # the push on its own CPU only
        ("disk", disk, {}, {"files": CheckpointFiles(ram_dir=False)}),
        ("durable", disk, {}, {"files": CheckpointFiles(durable=True)}),
        ("old_defaults", disk, {},
         {"files": CheckpointFiles(durable=True, keep_last_k=2), "verify": True})]
    engines: dict[tuple, Any] = {}
    try:
        for name, root, env, kwargs in levers:
            root.mkdir(parents=True, exist_ok=True, mode=0o700)
            if (key := (root, tuple(sorted(env.items())))) not in engines:
                for other in engines.values():  # one engine at a time: memory is shared
                    other.close()
                engines.clear()
                trim()
                log(f"{size}: engine with its checkpoint root in {fs_type(root)} ({root}) {env}")
                with engine_environment((), env):  # its processes read it when they start
                    engines[key] = ColocatedEngine(str(model), checkpoint_root=str(root),
                                                   **ENGINE_KWARGS)
            log(f"{size}: {name}")
            engines[key].verify_hash = kwargs.pop("verify", False)  # the engine checks hashes
            variants[name] = fit_measured(model, root, reps, engine=engines[key], **kwargs)
            engines[key].verify_hash = False
    finally:
        for engine in engines.values():
            engine.close()
        shutil.rmtree(ram, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    default = variants["default"]
    out["bytes"], out["two_copy_limit_s"] = default["bytes"], default["two_copies_s"]["median"]
    out["target"] = verdict(default["x_two_copies"], "<=", TARGET_X, "default sync (save_s + "
                            "push_s) / two memory copies of the model timed right before it, "
                            "median over the syncs after the first")
    return out

def _per_size(call: str, what: str) -> Any:
    """The section of ``call`` (``sync_size``: sizes from ``--sync-sizes``), each size a child."""
    name = call.split("_")[0]

    def run(args: Any, workdir: Path) -> dict[str, Any]:
        sizes = harness.per_size(f"benchmarks.sync:{call}", getattr(args, f"{name}_sizes"),
                                 workdir, logger(name), reps=args.sync_reps, shm=args.shm_dir)
        return {"what": what, "reps": args.sync_reps, "sizes": sizes}
    return run

section_sync = _per_size("sync_size", "the callback's sync in a real Trainer, by default and "
                         "with each lever on its own")

def render_sync(section: dict[str, Any]) -> str:
    lines = ["## Sync end to end (real Trainer, AdamW, every step)", "",
             line(["size", "variant", "dir", "save s", "push s", "save+push s", "x two copies",
                   "peak RSS+ MiB", "peak dir MiB"]), "|---" * 9 + "|"]
    for size, s in section.get("sizes", {}).items():
        if "error" in s:
            lines.append(line([size, f"error: {s['error']}", *[""] * 7]))
            continue
        lines.append(line([f"{size} ({s['bytes'] / 2**20:.0f} MiB)", "two-copy limit", "memory",
                           "", "", f"{s['two_copy_limit_s']:.3f}", "1.0", "", ""]))
        for name, v in s["variants"].items():
            rss, held = ((v[k] or 0) / 2**20 for k in ("peak_rss_extra_bytes", "peak_dir_bytes"))
            times = (f"{v[k]['median']:.3f}" for k in ("save_s", "push_s", "sync_s"))
            lines.append(line([size, name, v["fs"], *times, f"{v['x_two_copies']:.1f}",
                               f"{rss:.0f}", f"{held:.0f}"]))
    for size, s in section.get("sizes", {}).items():
        if (w := s.get("writer")) and "new_file" in w:
            cells = " | ".join(f"{k} {v['median']:.3f}" for k, v in w.items()
                               if isinstance(v, dict) and "median" in v)
            lines.append(f"\nWriter alone, {size}, {w['dir_fs']}, median s: {cells}")
    return "\n".join([*lines, "", f"Load during the section: {section.get('load', {})}", ""])

def default_size(size: str, workdir: str, reps: int, shm: str) -> dict[str, Any]:
    """One size of "default" (a child's call): per case, :data:`ORDER` on one engine."""
    from callbacks import CheckpointFiles
    from weight_bridge import ColocatedEngine
    work, log, out = Path(workdir), logger("default"), {"size": size, "cases": {}}
    model = harness.model_dir(work / f"sync_{size}", size)
    for case, (where, dtype, lr) in CASES.items():
        root = (Path(shm) if where == "ram" else work) / f"default-{size}-{case}"
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        in_ram = fs_type(root) == "tmpfs"
        files = CheckpointFiles() if in_ram else CheckpointFiles(durable=True)
        kwargs, runs = {**ENGINE_KWARGS, "dtype": dtype}, {name: [] for name in VARIANTS}
        engine = ColocatedEngine(str(model), checkpoint_root=str(root), **kwargs)
        try:
            for i, name in enumerate(ORDER):
                log(f"{root.name}: {name} (delta={VARIANTS[name]!r})")
                runs[name].append(fit_measured(model, root / f"{i}-{name}", reps, lr,
                                               VARIANTS[name], engine=engine, files=files))
        finally:
            engine.close()
            shutil.rmtree(root, ignore_errors=True)
        variants = {name: {
            "runs": len(r), "sync_s": stats(t for s in r for t in s["sync_s"]["samples"]),
            "x_two_copies": statistics.median(x for s in r for x in s["x_two_copies_per_sync"]),
            "deltas": [d for s in r for d in s["deltas"]],
            "choices": [c for s in r for c in s["choices"]], "per_run": r}
            for name, r in runs.items()}
        median = {n: v["sync_s"]["median"] for n, v in variants.items()}
        c = out["cases"][case] = {
            "fs": fs_type(root), "dtype": dtype, "lr": lr, "variants": variants,
            "default_vs_complete": median["default"] / median["complete"],
            "delta_vs_complete": median["delta"] / median["complete"],
            "default_x_two_copies": variants["default"]["x_two_copies"]}
        if in_ram:
            targets = [verdict(c["default_vs_complete"], "<=", TARGET_VS_COMPLETE, "default / "
                               "complete sync, medians"), verdict(c["default_x_two_copies"], "<=",
                               TARGET_X_TWO_COPIES, "default sync / two memory copies")]
            what = (f"default sync <= {TARGET_VS_COMPLETE}x a complete one (medians, same run) "
                    f"and <= {TARGET_X_TWO_COPIES}x two memory copies")
            c["target"] = {"what": what, "met": all(t["met"] for t in targets), "targets": targets}
    return out

section_default = _per_size("default_size", "delta='auto' against complete syncs and deltas, "
                            "real Trainer runs on one engine")

def render_default(section: dict[str, Any]) -> str:
    lines, notes = ['## Default sync (`delta="auto"`) against complete syncs and deltas (real '
                    "Trainer)", "", line(["size", "case", "variant", "deltas sent",
                    "save+push s (median)", "x complete", "x two copies"]), "|---" * 7 + "|"], []
    for size, s in section.get("sizes", {}).items():
        if "error" in s:
            lines.append(line([size, f"error: {s['error']}", *[""] * 5]))
        for case, c in s.get("cases", {}).items():
            complete = c["variants"]["complete"]["sync_s"]["median"]
            for name, v in c["variants"].items():
                m = v["sync_s"]["median"]
                lines.append(line([size, case, name, f"{sum(v['deltas'])} of {len(v['deltas'])}",
                                   f"{m:.3f}", f"{m / complete:.2f}", f"{v['x_two_copies']:.1f}"]))
            if "target" in c:
                met = "met" if c["target"]["met"] else "missed"
                notes.append(f"\n{size} {case}: {c['target']['what']}: {met}")
            why = c["variants"]["default"]["choices"][-1]
            notes.append(f"\n{size} {case}, the default's reason at its last sync: {why}")
    load = f"Load during the section: {section.get('load', {})}"
    return "\n".join([*lines, *notes, "", load, ""])

def fsdp_job(kind: str, model: str, reps: int, sync_dir: str) -> dict[str, Any] | None:
    """One job (both ranks run it): FSDP2 on each decoder layer and the model, or DDP."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from callbacks import CheckpointFiles, EngineSpec, Schedule
    shard, gather = kind == "fsdp", {}
    sync = measured_sync("every", engine=EngineSpec(model=model, options={"engine_args": dict(
        ENGINE_KWARGS)}), schedule=Schedule(every_n_train_steps=1),
        files=CheckpointFiles(dirpath=sync_dir, keep_last_k=2))

    class FullGather(pl.Callback):  # every rank calls it; rank zero gets the model
        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            harness.trim()
            with harness.RssSampler([os.getpid()], interval=0.001) as sampler:
                t0 = time.perf_counter()
                state = get_model_state_dict(pl_module.model, options=options)
                elapsed = time.perf_counter() - t0
            del state
            if trainer.is_global_zero:
                gather.update(sampler.report(), elapsed_s=elapsed)

    module = harness.policy(model, lr=1e-3, tokens=16, batch=2, sgd=True, shard=shard)
    strategy = "ddp"
    if shard:
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = harness.fit(module, [sync, FullGather()] if shard else [sync], reps, devices=2,
                          strategy=strategy)
    if trainer.is_global_zero:
        return {"syncs": sync.history, "memory": sync.memory, "full_gather": gather}
    return None

def section_fsdp(args: Any, workdir: Path) -> dict[str, Any]:
    """The FSDP and the DDP job (medians over the syncs after the first), compared."""
    from weight_bridge.checkpoint import CheckpointReader
    size, reps, log = args.fsdp_size, args.fsdp_reps, logger("fsdp")
    log(f"building the {size} model")
    model = harness.model_dir(workdir / f"{size}_fsdp", size)
    with CheckpointReader(model / "model.safetensors") as reader:
        sizes = [e.end - e.begin for f in reader.files for e in f.entries.values()]
    result: dict[str, Any] = {"size": size, "model_bytes": sum(sizes), "largest_tensor": max(sizes)}
    # glibc maps what is above 1 MiB (else freed memory stays resident): a peak is the sync's
    env = {harness.MULTIPROCESSING: "1", "MALLOC_MMAP_THRESHOLD_": "1048576"}
    for kind in ("fsdp", "ddp"):
        log(f"{kind} job: 2 ranks with an engine each, {reps + 1} syncs")
        started = time.perf_counter()
        raw = harness.child("benchmarks.sync:fsdp_job", workdir / f"{kind}.json", env, kind=kind,
                            model=model, reps=reps, sync_dir=workdir / f"sync-{kind}")
        if "error" in raw:
            raise RuntimeError(f"the {kind} job failed: {raw['error']}")
        raw["job_wall_s"] = time.perf_counter() - started
        syncs, memory = raw["syncs"][1:] or raw["syncs"], raw["memory"][1:] or raw["memory"]
        hwm = [m["hwm_extra_total"] or 0 for m in raw["memory"]]
        result[kind] = {
            "syncs": len(raw["syncs"]), "save_s": statistics.median(s["save_s"] for s in syncs),
            "push_s": statistics.median(s["push_s"] for s in syncs),
            "sync_s": statistics.median(s["save_s"] + s["push_s"] for s in syncs),
            "peak_extra_hwm": max(hwm), "peak_extra_anon": max(m["peak_extra_anon"] for m in
                                                               raw["memory"]),
            "peak_extra_hwm_median": statistics.median(m["hwm_extra_total"] or 0 for m in memory),
            "job_wall_s": raw["job_wall_s"], "raw": raw}
    fsdp, ddp, largest, nbytes = result["fsdp"], result["ddp"], max(sizes), sum(sizes)
    fsdp["full_gather"] = fsdp["raw"]["full_gather"]
    peak = max(fsdp["peak_extra_hwm"], fsdp["peak_extra_anon"])
    result["targets"] = {"fsdp_writer_peak": verdict(
        peak, "<=", FSDP_FACTOR * largest + FSDP_FIXED, "writer's peak extra resident memory "
        "during an FSDP sync <= 1.2 x largest tensor + 64 MiB")}
    result["ratios"] = {
        "fsdp_peak_vs_largest": peak / largest, "fsdp_peak_vs_model": peak / nbytes,
        "full_gather_peak_vs_model": fsdp["full_gather"].get("hwm_extra_total", 0) / nbytes,
        "fsdp_vs_ddp_sync_s": fsdp["sync_s"] / ddp["sync_s"],
        "fsdp_vs_ddp_save_s": fsdp["save_s"] / ddp["save_s"]}
    return result

def render_fsdp(result: dict[str, Any]) -> str:
    mib, f, d = 2**20, result["fsdp"], result["ddp"]
    t, gather = result["targets"]["fsdp_writer_peak"], f["full_gather"]
    rows = [[name, f"{s['save_s']:.3f}", f"{s['push_s']:.3f}", f"{s['sync_s']:.3f}",
             f"{s['peak_extra_hwm'] / mib:.1f} MiB", f"{s['peak_extra_anon'] / mib:.1f} MiB"]
            for name, s in (("FSDP2 (streamed gather)", f), ("DDP", d))]
    rows.append(["torch full gather (`get_model_state_dict`, rank 0)", f"{gather['elapsed_s']:.3f}",
                 "", "", f"{(gather['hwm_extra_total'] or 0) / mib:.1f} MiB",
                 f"{gather['peak_extra_anon'] / mib:.1f} MiB"])
    return "\n".join([
        f"## FSDP2 sync vs DDP sync ({result['size']}, 2 ranks)", "",
        f"model {result['model_bytes'] / mib:.1f} MiB, largest tensor "
        f"{result['largest_tensor'] / mib:.1f} MiB", "",
        *harness.table(["", "save s", "push s", "sync s", "writer peak extra (VmHWM)",
                "peak extra RssAnon"], rows), "",
        f"target: writer peak {t['value'] / mib:.1f} MiB <= {t['limit'] / mib:.1f} MiB (1.2 x "
        f"largest + 64 MiB): {'met' if t['met'] else 'MISSED'}; FSDP sync / DDP sync = "
        f"{result['ratios']['fsdp_vs_ddp_sync_s']:.2f}"])
# fmt: on
