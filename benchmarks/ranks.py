"""Benchmark: the engine inside the trainer's ranks (``EngineSpec(mode="ranks")``), side by side.

    python -m benchmarks.ranks --out bench/results-ranks.json             # 100m, 5 reps
    python -m benchmarks.ranks --size 1m --reps 2 --out /tmp/ranks.json   # smoke run

Two ranks under ``torchrun`` (gloo), each with vLLM inside it (external launcher, TP=2 over the
two ranks, one core each), the "trainer's tensors" a full fp32 state in each rank's memory. In
the same run, interleaved round-robin ``--reps`` times, every rank times:

* ``live``: :meth:`~weight_bridge.vllm.clients.ranks.RanksEngine.push_tensors` of the trainer's
  tensors (this mode's push: validation, the write through each weight's loader into the live
  storage, read-back, the refresh of derived state; the CPU re-pack of linears for oneDNN is
  the report's ``refresh_s``, on its own line);
* ``copy``: one memory copy of the engine's bytes: every parameter of this rank's worker copied
  into preallocated memory (``copy_``), inside the engine (the floor of any write);
* ``file``: today's path, the same tensors saved as a safetensors file in ``/dev/shm``
  (:func:`~weight_bridge.checkpoint.save_checkpoint`) and pushed from it;
* ``load_weights``: the anchor's way (TRL's colocate mode): ``model.load_weights([(name,
  tensor)])`` per parameter from the trainer's tensors, in the same engine (no validation, no
  read-back, no rollback; on this CPU it does not re-pack, so the engine then generates with
  stale packs: ``correct`` says whether it equals a cold start).

Then the footprint of each rank: processes and extra resident memory of the engine, this mode
against the default (a colocated engine per rank: vLLM's multi-process engine, TP=1), each
measured as the rank's process tree after the engine started minus before.

Correctness in every run: after the timed pushes, the last ``live`` push (model B) must equal a
cold TP=2 engine on B (greedy tokens, top-3 logprobs). Targets: ``live`` at most 2x ``copy``
plus the re-pack. Reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .section import run_section

__all__ = ["bench_ranks", "main", "render"]

TARGET_FACTOR = 2.0


def _median(values: list[float]) -> float:
    s = sorted(values)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def _tree(pid: int) -> tuple[int, int]:
    """Processes and resident bytes of ``pid`` and its descendants."""
    from .machine import descendants

    pids = [pid, *descendants(pid)]
    rss = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/statm") as f:
                rss += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            pass
    return len(pids), rss


def _footprint(start: Any) -> tuple[Any, dict[str, int]]:
    before = _tree(os.getpid())
    engine = start()
    after = _tree(os.getpid())
    return engine, {"processes": after[0], "extra_rss": after[1] - before[1]}


# -- the job each rank runs (this module under torchrun) ------------------------------------------


def _tensors(model: Path) -> dict[str, Any]:
    from weight_bridge.checkpoint import CheckpointReader

    with CheckpointReader(model / "model.safetensors") as reader:
        return {name: t.clone() for name, t in reader.tensors()}


def _job(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from weight_bridge.checkpoint import save_checkpoint
    from weight_bridge.testing.parity import check_parity, greedy
    from weight_bridge.vllm.clients.ranks import RanksEngine

    from .config import ENGINE_KWARGS

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    kwargs = dict(ENGINE_KWARGS, checkpoint_root=str(args.workdir), cpu_threads_bind="0|1")
    model_a, model_b = Path(args.model_a), Path(args.model_b)
    engine, footprint = _footprint(lambda: RanksEngine(model_a, **kwargs))
    states = [_tensors(model_b), _tensors(model_a)]
    copies = engine.llm.collective_rpc(_preallocate)  # this rank's worker only
    times: dict[str, list[float]] = {k: [] for k in ("live", "copy", "file", "load_weights")}
    parts: dict[str, list[float]] = {k: [] for k in ("preflight_s", "write_s", "refresh_s")}
    for i in range(args.reps):
        state = states[i % 2]  # every push changes every value
        started = time.perf_counter()
        report = engine.push_tensors(state, version=f"live-{i}")
        times["live"].append(time.perf_counter() - started)
        for key in parts:
            parts[key].append(float(getattr(report, key)))
        times["copy"].append(engine.llm.collective_rpc(_copy_all)[0])
        path = args.workdir / f"rank{rank}-{i}.safetensors"
        started = time.perf_counter()  # today's path: the file saved, then pushed
        save_checkpoint(states[(i + 1) % 2], path)
        engine.push(path, version=f"file-{i}")
        times["file"].append(time.perf_counter() - started)
        path.unlink()
        times["load_weights"].append(
            engine.llm.collective_rpc(_load_weights_each, args=(states[i % 2],))[0]
        )
    del copies
    _COPIES.clear()
    engine.push_tensors(states[1], version="A")  # from A: the anchor's load of B...
    engine.llm.collective_rpc(_load_weights_each, args=(states[0],))
    anchor = greedy(engine)
    engine.push_tensors(states[1], version="A")  # ...and, from A again, the bridge's push of B
    engine.push_tensors(states[0], version="B")
    pushed = greedy(engine)
    engine.close()
    cold = RanksEngine(model_b, **kwargs)
    reference = greedy(cold)
    cold.close()
    dist.barrier()
    result = {
        "rank": rank,
        "median_s": {k: _median(v) for k, v in times.items()},
        "runs_s": times,
        "live_parts_s": {k: _median(v) for k, v in parts.items()},
        "bytes": sum(t.numel() * t.element_size() for t in states[0].values()),
        "footprint": footprint,
        "correct": {
            "live": check_parity(pushed, reference).match,
            "load_weights": check_parity(anchor, reference).match,
        },
        "threads": torch.get_num_threads(),
    }
    (args.workdir / f"ranks-{rank}.json").write_text(json.dumps(result))


_COPIES: list = []  # (live parameter, its preallocated copy): the worker is in this process


def _preallocate(worker: Any) -> int:
    import torch

    _COPIES[:] = [(p, torch.empty_like(p)) for p in worker.model_runner.get_model().parameters()]
    return len(_COPIES)


def _copy_all(worker: Any) -> float:
    started = time.perf_counter()
    for source, copy in _COPIES:
        copy.copy_(source)
    return time.perf_counter() - started


def _load_weights_each(worker: Any, state: dict) -> float:
    """TRL's colocate sync: one ``load_weights`` call per parameter, from the trainer's tensor."""
    model = worker.model_runner.get_model()
    started = time.perf_counter()
    for name, tensor in state.items():
        model.load_weights([(name, tensor)])
    return time.perf_counter() - started


def _default_footprint(args: argparse.Namespace) -> None:
    """The default mode's engine per rank: a colocated, multi-process engine (TP=1)."""
    from weight_bridge.vllm import ColocatedEngine

    from .config import ENGINE_KWARGS

    kwargs = dict(ENGINE_KWARGS, checkpoint_root=str(args.workdir))
    engine, footprint = _footprint(lambda: ColocatedEngine(args.model_a, **kwargs))
    engine.close()
    (args.workdir / "default.json").write_text(json.dumps(footprint))


# -- the section --------------------------------------------------------------------------------


def bench_ranks(workdir: Path, size: str, reps: int, log: Any = print) -> dict[str, Any]:
    """Both footprints and the timed pushes, one run; the section's result."""
    from .measure import build_models

    model_a, model_b = build_models(workdir, size)
    common = ["--model-a", str(model_a), "--model-b", str(model_b), "--workdir", str(workdir)]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    root = str(Path(__file__).resolve().parents[1])
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m",
         "benchmarks.ranks", "--_job", "--reps", str(reps), *common],
        env=env, cwd=root, check=True,
    )  # fmt: skip
    log(f"ranks job took {time.perf_counter() - started:.0f} s")
    subprocess.run(
        [sys.executable, "-m", "benchmarks.ranks", "--_default", *common],
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, cwd=root, check=True,
    )  # fmt: skip
    ranks = [json.loads((workdir / f"ranks-{r}.json").read_text()) for r in (0, 1)]
    slowest = {k: max(r["median_s"][k] for r in ranks) for k in ranks[0]["median_s"]}
    repack = max(r["live_parts_s"]["refresh_s"] for r in ranks)
    return {
        "size": size,
        "reps": reps,
        "bytes": ranks[0]["bytes"],
        "median_s": slowest,  # the slower rank's median: a push ends when both ranks did
        "repack_s": repack,
        "live_over_copy": slowest["live"] / slowest["copy"],
        "live_without_repack_over_copy": (slowest["live"] - repack) / slowest["copy"],
        "target": f"live - repack <= {TARGET_FACTOR}x copy",
        "target_met": slowest["live"] - repack <= TARGET_FACTOR * slowest["copy"],
        "footprint_per_rank": {
            "ranks": ranks[0]["footprint"],
            "default": json.loads((workdir / "default.json").read_text()),
        },
        "correct": {k: all(r["correct"][k] for r in ranks) for k in ranks[0]["correct"]},
        "ranks": ranks,
    }


def render(result: dict[str, Any]) -> str:
    """The section's two tables, as docs/benchmarks.md quotes them."""
    m, repack, mib = result["median_s"], result["repack_s"], 2**20
    met = "met" if result["target_met"] else "missed"
    rows = [
        ("one memory copy of the engine's bytes (each rank's parameters, `copy_` inside the "
         "engine)", m["copy"], "1.00x"),
        ("this mode: `push_tensors` from the live tensors", m["live"],
         f"{m['live'] / m['copy']:.2f}x"),
        ("of which the CPU re-pack of linears for oneDNN (the report's `refresh_s`)", repack,
         f"{repack / m['copy']:.2f}x"),
        ("this mode without the re-pack", m["live"] - repack,
         f"{result['live_without_repack_over_copy']:.2f}x (target 2x: {met})"),
        ("today's file path: `save_checkpoint` to `/dev/shm`, then a push of the file",
         m["file"], f"{m['file'] / m['copy']:.2f}x ({m['file'] / m['live']:.2f}x this mode)"),
        ("TRL's way: `model.load_weights([(name, tensor)])` per parameter, same engine",
         m["load_weights"], f"{m['load_weights'] / m['copy']:.2f}x"),
    ]  # fmt: skip
    lines = ["| per push | s | / one copy |", "|---|---|---|"]
    lines += [f"| {what} | {s:.3f} | {ratio} |" for what, s, ratio in rows]
    fp = result["footprint_per_rank"]
    lines += ["", "| | processes | extra resident memory |", "|---|---|---|"]
    lines.append(
        f"| this mode (TP=2 over the ranks) | {fp['ranks']['processes']} | "
        f"{fp['ranks']['extra_rss'] / mib:.0f} MiB |"
    )
    lines.append(
        "| the default mode (a colocated engine per rank: vLLM's multi-process engine, TP=1) | "
        f"{fp['default']['processes']} | {fp['default']['extra_rss'] / mib:.0f} MiB |"
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="100m")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--render", type=Path, help="only redraw the .md of a results JSON")
    parser.add_argument("--_job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--_default", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-a", help=argparse.SUPPRESS)
    parser.add_argument("--model-b", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._job:
        _job(args)
        return 0
    if args._default:
        _default_footprint(args)
        return 0

    def run() -> dict[str, Any]:
        with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="bench-ranks-") as tmp:
            return bench_ranks(Path(tmp), args.size, args.reps)

    result = run_section(run, render, args.out, args.render)
    if result is None:
        return 0
    return 0 if result["correct"]["live"] else 1  # the anchor's correctness is reported


if __name__ == "__main__":
    sys.exit(main())
