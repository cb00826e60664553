"""Benchmark section "default sync": what ``Schedule()`` as it comes costs, against each kind.

    python -m benchmarks --only default --out bench/results.json   # make bench-default

A delta saves bytes, not necessarily time (:mod:`weight_bridge.checkpoint.delta_choice`), so the
default ``delta="auto"`` must cost no more than the kind it should pick. For each size (the 100M
Llama, fp32, untied, AdamW) and each case below, one bridged engine (vLLM's default
multi-process engine) serves real ``Trainer`` runs in a row, a sync after every step, in one run
of this section: ``default``, ``complete``, ``delta``, ``complete``, ``default`` (so that neither
of the two compared gains from its place on the engine; each variant's syncs pooled):

* ``default``: ``VLLMWeightSync`` with every default (``delta="auto"``);
* ``complete``: ``delta="off"``: every sync a full one, in the engine's dtypes;
* ``delta``: ``delta="on"``: a keyframe, then deltas.

Cases: where the bytes go, the engine's dtype and the learning rate.

* ``ram_fp32_lr1e-4`` and ``ram_bf16_lr1e-4``: the transport in ``/dev/shm`` (the callback's
  default), AdamW at 1e-4, where nearly every value changes every step: host memory carries
  every byte, so ``auto`` sends full syncs and keeps no reference copy;
* ``disk_bf16_lr1e-6``: checkpoints that survive a crash (``durable=True``: on a disk, each
  fsynced), a bf16 engine, AdamW at 1e-6, where about 1 % of the bf16 values change a step:
  bytes cost more than reading them, so ``auto`` measures a full sync, probes a delta and keeps
  the cheaper.

Per run: the callback's ``save_s`` + ``push_s`` per sync after the first (first-touch costs),
median and spread, and the same two-memory-copies limit as the "sync end to end" section, timed
right before each sync (:func:`~benchmarks.sync.fit_measured`); the kinds sent and each sync's
recorded reason. Targets (on the RAM cases): ``default`` within :data:`TARGET_VS_COMPLETE` of
``complete``, and within :data:`TARGET_X_TWO_COPIES` two memory copies (the default's cost
before deltas).
"""

from __future__ import annotations

import shutil
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .machine import CpuLoad, fs_type
from .per_size import reps_child_main, run_sizes, section_in
from .sync import fit_measured, free_memory, model_dir_of, summarise

__all__ = ["CASES", "DEFAULT_SIZES", "bench_default", "default_section", "render_default"]

DEFAULT_SIZES = ("100m",)
# name -> (where the files go, the engine's dtype, AdamW's learning rate)
CASES: dict[str, tuple[str, str, float]] = {
    "ram_fp32_lr1e-4": ("ram", "float32", 1e-4),
    "ram_bf16_lr1e-4": ("ram", "bfloat16", 1e-4),
    "disk_bf16_lr1e-6": ("disk", "bfloat16", 1e-6),
}
VARIANTS = {"default": "auto", "complete": "off", "delta": "on"}
# the runs in order: default and complete twice, around the delta run (ABCBA), so that neither
# gains from its place on the engine (the first run after its start, or the last)
ORDER = ("default", "complete", "delta", "complete", "default")
TARGET_VS_COMPLETE = 1.1  # the default sync's median within 1.1x a complete sync's
TARGET_X_TWO_COPIES = 4.7  # and within 4.7x two memory copies, as before deltas


def _bench_case(
    model_dir: Path, root: Path, dtype: str, lr: float, reps: int, log: Callable[[str], None]
) -> dict[str, Any]:
    from callbacks import CheckpointFiles
    from weight_bridge.vllm import ColocatedEngine

    from .config import ENGINE_KWARGS

    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    in_ram = fs_type(root) == "tmpfs"
    files = CheckpointFiles() if in_ram else CheckpointFiles(durable=True)
    out: dict[str, Any] = {"fs": fs_type(root), "dtype": dtype, "lr": lr, "variants": {}}
    engine = ColocatedEngine(
        str(model_dir), checkpoint_root=str(root), **{**ENGINE_KWARGS, "dtype": dtype}
    )
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
    try:
        for i, name in enumerate(ORDER):
            delta = VARIANTS[name]
            log(f"{root.name}: {name} (delta={delta!r})")
            where = root / f"{i}-{name}"
            sync = fit_measured(
                model_dir, where, reps, lr=lr, delta=delta, engine=engine, files=files
            )[0]
            runs[name].append(summarise(sync))
            del sync
            free_memory()
    finally:
        engine.close()
        shutil.rmtree(root, ignore_errors=True)
    for name, summaries in runs.items():
        out["variants"][name] = _pooled(summaries)
    median = {n: v["sync_s"]["median"] for n, v in out["variants"].items()}
    out["default_vs_complete"] = median["default"] / median["complete"]
    out["delta_vs_complete"] = median["delta"] / median["complete"]
    out["default_x_two_copies"] = out["variants"]["default"]["x_two_copies"]
    if in_ram:
        out["target"] = {
            "what": f"default sync <= {TARGET_VS_COMPLETE}x a complete one (medians, same run) "
            f"and <= {TARGET_X_TWO_COPIES}x two memory copies",
            "met": out["default_vs_complete"] <= TARGET_VS_COMPLETE
            and out["default_x_two_copies"] <= TARGET_X_TWO_COPIES,
        }
    return out


def _pooled(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's runs as one: the syncs of every run (times, ratios to the two-copy limit
    taken per sync), each run's kinds and reasons."""
    from .stats import stats

    times = [t for s in summaries for t in s["sync_s"]["samples"]]
    ratios = [x for s in summaries for x in s["x_two_copies_per_sync"]]
    return {
        "runs": len(summaries),
        "sync_s": stats(times),
        "x_two_copies": statistics.median(ratios),
        "deltas": [d for s in summaries for d in s["deltas"]],
        "choices": [c for s in summaries for c in s["choices"]],
        "per_run": summaries,
    }


def _bench_size(
    size: str, workdir: Path, reps: int, shm: Path, log: Callable[[str], None]
) -> dict[str, Any]:
    model_dir = model_dir_of(workdir, size)
    out: dict[str, Any] = {"size": size, "cases": {}}
    for case, (where, dtype, lr) in CASES.items():
        root = (shm if where == "ram" else workdir) / f"default-{size}-{case}"
        out["cases"][case] = _bench_case(model_dir, root, dtype, lr, reps, log)
    return out


def bench_default(
    workdir: Path, sizes: list[str], reps: int, shm: Path, log: Callable[[str], None]
) -> dict[str, Any]:
    """Every size, each in a process of its own (see the module)."""
    load = CpuLoad()
    result: dict[str, Any] = {
        "what": __doc__.split("\n\n")[1].replace("\n", " ") if __doc__ else "",
        "reps": reps,
    }
    result["sizes"] = run_sizes(
        "benchmarks.default_sync", sizes, ["--reps", str(reps)], workdir, shm, log
    )
    result["load"] = load.report()
    return result


def default_section(args: Any, workdir: Path) -> dict[str, Any]:
    """The section from ``python -m benchmarks``'s arguments (``--default-sizes``)."""
    return section_in(
        workdir,
        "default",
        lambda d, log: bench_default(d, args.default_sizes, args.sync_reps, args.shm_dir, log),
    )


def main(argv: list[str] | None = None) -> int:
    """One size of the section (what :func:`bench_default` runs in a child)."""
    return reps_child_main("benchmarks.default_sync", argv, _bench_size)


def render_default(section: dict[str, Any]) -> str:
    """The section as a markdown table."""
    lines = [
        '## Default sync (`delta="auto"`) against complete syncs and deltas (real Trainer)',
        "",
        "| size | case | variant | deltas sent | save+push s (median) | x complete | "
        "x two copies |",
        "|---|---|---|---|---|---|---|",
    ]
    for size, s in section.get("sizes", {}).items():
        if "error" in s:
            lines.append(f"| {size} | error: {s['error']} | | | | | |")
            continue
        for case, c in s["cases"].items():
            complete = c["variants"]["complete"]["sync_s"]["median"]
            for name, v in c["variants"].items():
                sent = sum(v["deltas"])
                median = v["sync_s"]["median"]
                lines.append(
                    f"| {size} | {case} | {name} | {sent} of {len(v['deltas'])} | {median:.3f} "
                    f"| {median / complete:.2f} | {v['x_two_copies']:.1f} |"
                )
    for size, s in section.get("sizes", {}).items():
        for case, c in s.get("cases", {}).items():
            if "target" in c:
                met = "met" if c["target"]["met"] else "missed"
                lines.append(f"\n{size} {case}: {c['target']['what']}: {met}")
            why = c["variants"]["default"]["choices"][-1]
            lines.append(f"\n{size} {case}, the default's reason at its last sync: {why}")
    lines += ["", f"Load during the section: {section.get('load', {})}", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
