"""The figure of a results JSON (matplotlib, Agg)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from .config import GEN_BATCH, GLIBC
from .report import TIME_ROWS, dig, fmt_load, getter


def render_plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = results["sizes"]
    names = list(sizes)
    fig, axes = plt.subplots(2, 2, figsize=(15, 10))

    def bars(ax: Any, series: list[tuple[str, Callable[[dict], Any]]], xs_names: list[str]) -> None:
        width = 0.8 / max(1, len(series))
        for i, (label, get) in enumerate(series):
            med, lo, hi = [], [], []
            for n in xs_names:
                d = get(sizes[n]) or {}
                mid = d.get("median")
                mid = float("nan") if mid is None else mid
                med.append(mid)
                lo.append(mid - d["min"] if d.get("min") is not None else 0)
                hi.append(d["max"] - mid if d.get("max") is not None else 0)
            xs = [j + (i - len(series) / 2 + 0.5) * width for j in range(len(xs_names))]
            ax.bar(xs, med, width, yerr=[lo, hi], label=label, capsize=2)
        ax.set_xticks(range(len(xs_names)))
        ax.set_xticklabels(
            [f"{n}\n{sizes[n]['model']['bytes'] / 2**20:.0f} MiB" for n in xs_names], fontsize=8
        )
        ax.legend(fontsize=7)

    for ax, eng, title in (
        (axes[0][0], "multiprocess", "multi-process engine (vLLM default)"),
        (axes[0][1], "inprocess", "in-process engine"),
    ):
        series: list[tuple[str, Callable[[dict], Any]]] = [
            (label.replace("**", ""), getter(eng, key)) for label, key in TIME_ROWS
        ]
        if eng == "inprocess":
            series.append(("cold restart", lambda s: dig(s, "inprocess", "cold_restart")))
        bars(ax, series, names)
        ax.set_yscale("log")
        ax.set_ylabel("seconds (median, min–max)")
        ax.set_title(f"Reload a checkpoint: {title}", fontsize=10)

    ax = axes[1][0]
    bars(
        ax,
        [
            ("save_checkpoint, disk", lambda s: dig(s, "save", "disk", "save_checkpoint")),
            ("raw write+fsync, disk", lambda s: dig(s, "save", "disk", "raw_write")),
            ("save_checkpoint, /dev/shm", lambda s: dig(s, "save", "shm", "save_checkpoint")),
            ("raw write+fsync, /dev/shm", lambda s: dig(s, "save", "shm", "raw_write")),
            ("blake3 only", lambda s: dig(s, "save", "disk", "hash_only")),
        ],
        names,
    )
    ax.set_yscale("log")
    ax.set_ylabel("seconds (median, min–max)")
    ax.set_title("Save a checkpoint (both fsynced)", fontsize=10)

    ax = axes[1][1]
    gen_names = [n for n in names if dig(sizes[n], "multiprocess", "generation")]
    bars(
        ax,
        [
            (mode, getter("multiprocess", "generation", mode, "tokens_per_s"))
            for mode in ("repack", GLIBC, "torch", "stock")
        ],
        gen_names,
    )
    ax.set_ylabel("tokens/s (median, min–max)")
    ax.set_title(f"Generation, greedy batch of {GEN_BATCH}, multi-process engines", fontsize=10)
    m = results["machine"]
    fig.suptitle(
        f"weight-bridge bench: {m['cpu_model']}, {m['cores']} cores, torch "
        f"{results['versions'].get('torch')}, vllm {results['versions'].get('vllm')}, "
        f"load avg {fmt_load(results.get('load', {}).get('loadavg_start'))} at start",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
