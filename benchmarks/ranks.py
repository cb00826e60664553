"""Section "ranks": the engine in the ranks (torchrun, TP=2): ``push_tensors`` against one copy,
the file path, TRL's ``load_weights`` with and without the same refresh; footprints; outputs."""

from __future__ import annotations

import itertools
import os
import statistics
import time
from pathlib import Path
from typing import Any

from . import harness
from .harness import ENGINE_KWARGS, MULTIPROCESSING, child, footprint, line, table, verdict

# fmt: off
TARGET_FACTOR = 2.5  # live without the re-pack, at most this many copies
TARGET_VS_ANCHOR = 1.25  # live, at most this many times TRL's load_weights plus the same refresh
_COPIES: list = []  # (live parameter, its preallocated copy): the worker is in this process

def _preallocate(worker: Any) -> None:
    _COPIES[:] = [(p, p.detach().clone()) for p in worker.model_runner.get_model().parameters()]

def _copy_all(worker: Any) -> float:
    return harness.timed(lambda: [copy.copy_(source) for source, copy in _COPIES])

def _store_settled(worker: Any) -> float:
    """Wait for the host store's copy in the background (off the push); what it took."""
    from weight_bridge.vllm.internals.model import transfer_engine
    store = transfer_engine(worker).transaction.store
    return store.wait() or store.refresh_s

def _load_weights(worker: Any, state: dict, refresh: bool) -> float:
    """TRL's colocate sync (``load_weights`` per parameter); ``refresh``: the bridge's refresh."""
    from weight_bridge.direct.derived import refresh_derived_state
    from weight_bridge.direct.state import bridge_state
    model, started = worker.model_runner.get_model(), time.perf_counter()
    modules = dict(bridge_state(model).refreshers) if refresh else {}
    for name, tensor in state.items():
        model.load_weights([(name, tensor)])
    refresh_derived_state(model, modules)
    return time.perf_counter() - started

def job(model_a: str, model_b: str, workdir: str, reps: int) -> dict[str, Any]:
    import torch.distributed as dist

    from weight_bridge.checkpoint import save_checkpoint
    from weight_bridge.testing.parity import check_parity, greedy
    from weight_bridge.vllm.clients.ranks import RanksEngine
    dist.init_process_group("gloo")
    rank, work = dist.get_rank(), Path(workdir)
    kwargs = dict(ENGINE_KWARGS, checkpoint_root=workdir, cpu_threads_bind="0|1")
    engine, fp = footprint(lambda: RanksEngine(Path(model_a), **kwargs))
    b, a = (harness.tensors_of(Path(m) / "model.safetensors") for m in (model_b, model_a))
    rpc, order = engine.llm.collective_rpc, itertools.cycle([b, a])
    rpc(_preallocate)  # this rank's worker only
    names = ("live", "copy", "file", "load_weights", "load_weights_refresh")
    times: dict[str, list[float]] = {k: [] for k in names}
    parts: dict[str, list[float]] = {k: [] for k in ("preflight_s", "write_s", "refresh_s")}
    store: list[float] = []
    for i in range(reps):  # live: the second of two pushes in a row (an RL loop's), timed
        engine.push_tensors(a, version=f"live-{i}-a")  # after the others wrote behind its back
        store.append(rpc(_store_settled)[0])  # its host store caught up, in the background
        started, report = time.perf_counter(), engine.push_tensors(b, version=f"live-{i}")
        times["live"].append(time.perf_counter() - started)
        [parts[key].append(float(getattr(report, key))) for key in parts]  # the report's parts
        rpc(_store_settled)  # nothing of it runs during the other ways' times
        times["copy"].append(rpc(_copy_all)[0])
        path = work / f"rank{rank}-{i}.safetensors"
        started = time.perf_counter()  # today's path: the file saved, then pushed
        save_checkpoint(next(order), path)
        engine.push(path, version=f"file-{i}")
        times["file"].append(time.perf_counter() - started)
        path.unlink()
        times["load_weights"].append(rpc(_load_weights, args=(next(order), False))[0])
        times["load_weights_refresh"].append(rpc(_load_weights, args=(next(order), True))[0])
    _COPIES.clear()
    outputs = {}
    for name in ("load_weights", "load_weights_refresh", "live"):  # each from A, B its way
        engine.push_tensors(a, version="A")
        if name == "live":
            engine.push_tensors(b, version="B")
        else:
            rpc(_load_weights, args=(b, name == "load_weights_refresh"))
        outputs[name] = greedy(engine)
    engine.close()
    reference = greedy(cold := RanksEngine(Path(model_b), **kwargs))
    cold.close()
    dist.barrier()
    return {"rank": rank, "median_s": {k: statistics.median(v) for k, v in times.items()},
            "runs_s": times, "live_parts_s": {k: statistics.median(v) for k, v in parts.items()},
            "bytes": sum(t.numel() * t.element_size() for t in b.values()), "footprint": fp,
            "correct": {k: check_parity(v, reference).match for k, v in outputs.items()},
            "store_refresh_s": statistics.median(store)}

def default_footprint(model_a: str, workdir: str) -> dict[str, int]:
    from weight_bridge import ColocatedEngine
    kwargs = dict(ENGINE_KWARGS, checkpoint_root=workdir)
    engine, fp = footprint(lambda: ColocatedEngine(model_a, **kwargs))
    engine.close()
    return fp

def section(args: Any, workdir: Path) -> dict[str, Any]:
    """Both footprints and the timed pushes, one run (in ``/dev/shm``: the file path's)."""
    size, reps, log = args.size or "100m", args.reps, harness.logger("ranks")
    with harness.scratch(args.shm_dir / f"bench-ranks-{os.getpid()}") as work:
        a, b = harness.build_models(work, size)
        started = time.perf_counter()
        ranks = child("benchmarks.ranks:job", work / "ranks-{rank}.json", {MULTIPROCESSING: "0"},
                      ranks=2, model_a=a, model_b=b, workdir=work, reps=reps)
        log(f"ranks job took {time.perf_counter() - started:.0f} s")
        default = child("benchmarks.ranks:default_footprint", work / "default.json",
                        {MULTIPROCESSING: "1"}, model_a=a, workdir=work)
    for failed_child in (ranks, default):
        if isinstance(failed_child, dict) and "error" in failed_child:
            raise RuntimeError(failed_child["error"])
    m = {k: max(r["median_s"][k] for r in ranks) for k in ranks[0]["median_s"]}  # a push ends
    repack = max(r["live_parts_s"]["refresh_s"] for r in ranks)  # when both ranks did
    targets = {
        "live_without_repack": verdict((m["live"] - repack) / m["copy"], "<=", TARGET_FACTOR,
                                       "(live - the re-pack) / one copy of the engine's bytes"),
        "live_vs_load_weights_refresh": verdict(m["live"] / m["load_weights_refresh"], "<=",
                                                TARGET_VS_ANCHOR, "live / TRL's load_weights "
                                                "followed by the same refresh of derived state")}
    return {"size": size, "reps": reps, "bytes": ranks[0]["bytes"], "median_s": m,
            "repack_s": repack, "live_over_copy": m["live"] / m["copy"],
            "store_refresh_s": max(r["store_refresh_s"] for r in ranks),
            "live_without_repack_over_copy": (m["live"] - repack) / m["copy"],
            "live_over_load_weights_refresh": m["live"] / m["load_weights_refresh"],
            "targets": targets, "target": f"live - repack <= {TARGET_FACTOR}x copy",
            "target_met": targets["live_without_repack"]["met"],
            "footprint_per_rank": {"ranks": ranks[0]["footprint"], "default": default},
            "correct": {k: all(r["correct"][k] for r in ranks) for k in ranks[0]["correct"]},
            "ranks": ranks}

def failed(result: dict[str, Any]) -> bool:
    return not result["correct"]["live"]  # TRL's correctness is reported, not required

def render(result: dict[str, Any]) -> str:
    """The section's tables; the re-pack target's factor as the run stated it."""
    m, repack, mib = result["median_s"], result["repack_s"], 2**20
    check = max(r["live_parts_s"]["preflight_s"] for r in result["ranks"])
    factor = result["target"].split("<= ")[1].split("x")[0].removesuffix(".0")
    met = "met" if result["target_met"] else "missed"
    t, right = result["targets"]["live_vs_load_weights_refresh"], result["correct"]
    rows = [  # what, seconds, what follows its ratio to one copy
        ["one memory copy of the engine's bytes (each rank's parameters, `copy_` inside the "
         "engine)", m["copy"], ""],
        ["this mode: `push_tensors` from the live tensors", m["live"], ""],
        ["of which validation before any write (the report's `preflight_s`: NaN/Inf and range, "
         "each rank reading the part of each tensor it writes)", check, ""],
        ["of which the CPU re-pack of linears for oneDNN (the report's `refresh_s`)", repack, ""],
        ["this mode without the re-pack", m["live"] - repack, f" (target {factor}x: {met})"],
        [f"target: this mode without the re-pack at most {factor}x one copy",
         float(factor) * m["copy"], f" ({met})"],
        ["after it, off the push: the host store (its rollback source) catching up in the "
         "background", result["store_refresh_s"], ""],
        ["today's file path: `save_checkpoint` to `/dev/shm`, then a push of the file", m["file"],
         f" ({m['file'] / m['live']:.2f}x this mode)"],
        ["TRL's way: `model.load_weights([(name, tensor)])` per parameter, same engine",
         m["load_weights"], ""],
        ["TRL's way followed by the same refresh of derived state (the CPU re-pack)",
         m["load_weights_refresh"], f" (this mode {t['value']:.2f}x it, target {t['limit']}x: "
         f"{'met' if t['met'] else 'missed'}; equals a cold start: "
         f"{'yes' if right['load_weights_refresh'] else 'no'})"]]
    fp = result["footprint_per_rank"]
    lines = table(["per push", "s", "/ one copy"],
                  [[w, f"{s:.3f}", f"{s / m['copy']:.2f}x{r}"] for w, s, r in rows])
    lines += ["", line(["", "processes", "extra resident memory"]), "|---" * 3 + "|"]
    for what, f in (("this mode (TP=2 over the ranks)", fp["ranks"]),
                    ("the default mode (a colocated engine per rank: vLLM's multi-process engine, "
                     "TP=1)", fp["default"])):
        lines.append(line([what, f["processes"], f"{f['extra_rss'] / mib:.0f} MiB"]))
    return "\n".join(lines) + "\n"
# fmt: on
