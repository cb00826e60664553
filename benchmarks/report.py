"""The markdown report of a results JSON."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .config import DEFAULT_CPU_LINEAR, ENGINES, OTHER_CPU_LINEAR, REAL_MODEL, model_source
from .tables import dig, summary_tables


def _fmt_s(d: dict | None) -> str:
    if not d or d.get("median") is None:
        return "n/a" if not d or "error" not in d else "error"
    digits = 3 if d["median"] < 100 else 1
    return f"{d['median']:.{digits}f} [{d['min']:.{digits}f}–{d['max']:.{digits}f}]"


def _count(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0f}"


def _fmt_x(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}×"


def _mib(x: float | None) -> str:
    return "n/a" if x is None else f"{x / 2**20:.1f}"


def getter(*keys: str) -> Callable[[dict], Any]:
    return lambda s: dig(s, *keys)


TIME_ROWS = [
    ("copy_ limit", "copy"),
    ("read+copy limit (mmap, page cache)", "read_copy"),
    ("**push** (default guards)", "direct"),
    ("push, check_finite=False", "direct_no_finite"),
    ("push, verify_hash=True", "direct_verify_hash"),
    ("push, readback=off", "direct_readback_off"),
    ("push, readback=full", "direct_readback_full"),
    ("rollback after a failed push (the previous version re-written)", "rollback"),
    ("vLLM reload_weights through its API (collective_rpc, weights_path)", "vllm_api_reload"),
    ("vLLM layerwise reload_weights(weights_path=dir)", "layerwise_file"),
    ("vLLM layerwise reload_weights(weights_iterator=file)", "layerwise_iter"),
    ("naive per-tensor model.load_weights loop", "naive_loop"),
]


# Checks of older results files that could not fail, and what replaced them.
LEGACY_CHECKS = {
    "stock_own_reload_multiprocess": (
        "this run's vLLM engine started on B and was reloaded with B, which cannot differ "
        "from a cold start on B; replaced by stock_own_reload_a_to_b_multiprocess (started "
        "on A, reloaded with B), to be measured by the next `make bench`"
    ),
}


def describe_model(name: str, model: dict[str, Any]) -> str:
    """A size's models as they are; results without ``source`` predate reading each model's
    ``config.json`` (their ``arch`` and ``tied`` were constants), so they are described from
    how the benchmark builds that size."""
    if "source" in model:
        arch, tied, source = model["arch"], model["tied"], model["source"]
    else:
        arch, tied, source = "llama", name == REAL_MODEL, model_source(name)
    kind = "tied embeddings" if tied else "untied"
    return f"{name}: {source}; {arch.capitalize()} architecture, {kind}, {model['dtype']}"


def render_markdown(results: dict[str, Any]) -> str:
    m, v, st = results["machine"], results["versions"], results["settings"]
    load = results.get("load", {})
    lines = [
        "# weight-bridge benchmark",
        "",
        f"Command: `{results['command']}`  ",
        f"Date: {results['started']}, total {results.get('elapsed_s', 0):.0f} s  ",
        f"Machine: {m['cpu_model']}, {m['cores']} cores, "
        f"{(m['memory_total_bytes'] or 0) / 2**30:.1f} GiB RAM; copy_ bandwidth in the engine "
        f"worker {(m.get('copy_bandwidth_bytes_per_s') or 0) / 1e9:.2f} GB/s (payload, largest "
        "size, multi-process worker)  ",
        f"Versions: torch {v.get('torch')}, vllm {v.get('vllm')}, weight-bridge "
        f"{v.get('weight-bridge')}  ",
        f"Load average start / end: {fmt_load(load.get('loadavg_start'))} / "
        f"{fmt_load(load.get('loadavg_end'))}; CPU used by other processes during the run: "
        f"{100 * (load.get('cpu_other_share') or 0):.0f}% of the machine  ",
        f"Times in seconds, median [min–max] of {st['reps']} reps interleaved round-robin; "
        f"engines run with `{st['engine_kwargs']}`. Models: "
        + "; ".join(describe_model(n, s["model"]) for n, s in results["sizes"].items())
        + ".",
        "",
    ]
    sizes = results["sizes"]
    names = list(sizes)
    lines += summary_tables(results)
    header = "| | " + " | ".join(names) + " |"
    sep = "|---" * (len(names) + 1) + "|"

    def row(label: str, get: Callable[[dict], Any], fmt: Callable[[Any], str] = _fmt_s) -> str:
        return f"| {label} | " + " | ".join(fmt(get(sizes[n])) for n in names) + " |"

    lines += ["## Times (s)", "", header, sep]
    for eng in ENGINES:
        lines.append(
            row(
                f"CPU share used by other processes during the {eng} section",
                getter(eng, "load", "cpu_other_share"),
                lambda x: "n/a" if x is None else f"{100 * x:.0f}%",
            )
        )
    lines.append(
        row(
            "params / checkpoint MiB / largest tensor MiB",
            lambda s: s["model"],
            lambda mo: (
                f"{mo['params'] / 1e6:.0f}M / {_mib(mo['bytes'])} / "
                f"{_mib(mo['largest_tensor_bytes'])}"
            ),
        )
    )
    for eng, title in (("multiprocess", "multi-process engine"), ("inprocess", "in-process")):
        for label, key in TIME_ROWS:
            lines.append(row(f"{title}: {label}", getter(eng, key)))
    lines.append(
        row(
            "in-process: cold restart (ready engine)",
            lambda s: dig(s, "inprocess", "cold_restart"),
        )
    )
    lines.append(
        row(
            "multi-process: engine start-up (1 sample)",
            lambda s: dig(s, "multiprocess", "startup_s"),
            lambda x: "n/a" if x is None else f"{x:.3f}",
        )
    )
    for mode in (OTHER_CPU_LINEAR, DEFAULT_CPU_LINEAR):  # round-robin, engines on B
        lines.append(
            row(
                f"multi-process, cpu_linear={mode}: push (engines alive together, round-robin)",
                lambda s, mode=mode: dig(s, "multiprocess", "pushes_elsewhere", mode),
            )
        )
    for label, where, key in (
        ("save_checkpoint, disk", "disk", "save_checkpoint"),
        ("raw write + fsync, disk", "disk", "raw_write"),
        ("save_checkpoint, /dev/shm", "shm", "save_checkpoint"),
        ("raw write + fsync, /dev/shm", "shm", "raw_write"),
        ("blake3 of the bytes only", "disk", "hash_only"),
    ):
        lines.append(row(label, getter("save", where, key)))

    lines += ["", "## Ratios and targets (✓ met, ✗ missed)", "", header, sep]

    def ratio_cell(s: dict, eng: str | None, key: str) -> str:
        value = s["ratios"].get(key) if eng is None else s["ratios"].get(eng, {}).get(key)
        cell = _fmt_x(value)
        target = s["targets"].get(key if eng is None else f"{eng}.{key}")
        if target is not None and target["met"] is not None:
            cell += " ✓" if target["met"] else " ✗"
        return cell

    ratio_rows: list[tuple[str, str | None, str]] = []
    for eng, title in (("multiprocess", "multi-process"), ("inprocess", "in-process")):
        ratio_rows += [
            (
                f"{title}: push / read+copy (target ≤ 2.5 in-process, 100m)",
                eng,
                "direct_vs_read_copy",
            ),
            (f"{title}: push without NaN check / read+copy", eng, "direct_no_finite_vs_read_copy"),
            (f"{title}: NaN-check cost (push / push without)", eng, "finite_guard_cost"),
            (f"{title}: hash cost (push+verify / push)", eng, "verify_hash_cost"),
            (
                f"{title}: read-back cost (push / push readback=off, target ≤ 1.1)",
                eng,
                "readback_cost",
            ),
            (f"{title}: full read-back cost (readback=full / off)", eng, "readback_full_cost"),
            (f"{title}: rollback / push", eng, "rollback_vs_direct"),
            (f"{title}: faster layerwise / push (target ≥ 2)", eng, "layerwise_vs_direct"),
            (f"{title}: vLLM reload via its API / push", eng, "vllm_api_reload_vs_direct"),
            (f"{title}: naive loop / push", eng, "naive_vs_direct"),
            (
                f"{title}: (peak extra anon − 32 MiB) / largest tensor (target ≤ 1.2)",
                eng,
                "peak_anon_vs_largest",
            ),
        ]
    ratio_rows += [
        ("in-process: cold restart / push (target ≥ 100)", "inprocess", "cold_vs_direct"),
        ("multi-process: engine start-up / push", "multiprocess", "startup_vs_direct"),
        ("save / raw write, disk (target ≤ 1.5)", None, "save_vs_raw_disk"),
        ("save / raw write, /dev/shm (target ≤ 1.5)", None, "save_vs_raw_shm"),
    ]
    for label, which, key in ratio_rows:
        lines.append(
            f"| {label} | " + " | ".join(ratio_cell(sizes[n], which, key) for n in names) + " |"
        )

    lines += ["", "## Peak extra resident memory during one run of each path (MiB)", ""]
    lines += [
        "RssAnon is memory the path allocated; RssFile is the checkpoint's page cache mapped by "
        "the reader (not a copy); VmHWM is the kernel's exact peak of RSS (anon + file) after a "
        "reset. Sampled every 0.5 ms in a background thread.",
        "",
        "| size | largest tensor | engine | path | peak extra RssAnon | peak extra RssFile "
        "| VmHWM extra |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in names:
        s = sizes[n]
        largest = _mib(s["model"]["largest_tensor_bytes"])
        for eng in ENGINES:
            for path, p in (dig(s, eng, "memory") or {}).items():
                lines.append(
                    f"| {n} | {largest} | {eng} | {path} | {_mib(p.get('peak_extra_anon'))} | "
                    f"{_mib(p.get('peak_extra_file'))} | {_mib(p.get('hwm_extra_total'))} |"
                )

    lines += [
        "",
        "## Partial pushes (multi-process engine)",
        "",
        "A full push of B against partial checkpoints on top of it: `quarter` (the top layers, "
        "a quarter of the bytes: frozen lower layers) and `lora_attention` (every attention "
        "projection: LoRA adapters on attention, merged by the callback). Push time median "
        "[min–max]; bytes and time as a fraction of the full push, same engine, same run.",
        "",
        "| size | push | tensors | MiB | bytes / full | time (s) | time / full "
        "| modules refreshed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in names:
        part = dig(sizes[n], "multiprocess", "partial") or {}
        for kind in ("full", "quarter", "lora_attention"):
            p = part.get(kind)
            if not p:
                continue
            lines.append(
                f"| {n} | {kind} | {_count(dig(p, 'tensors', 'median'))} "
                f"| {_mib(dig(p, 'bytes', 'median'))} | {_fmt_x(p.get('bytes_vs_full', 1.0))} "
                f"| {_fmt_s(p)} | {_fmt_x(p.get('time_vs_full', 1.0))} "
                f"| {_count(dig(p, 'refreshed', 'median'))} |"
            )

    lines += ["", "## Correctness (greedy output after the push vs a cold start on B)", ""]
    checks = list(sizes[names[0]]["correctness"]["checks"])
    lines += ["| check | " + " | ".join(names) + " |", sep]
    notes = []
    for key in checks:
        cells = []
        for n in names:
            ch = sizes[n]["correctness"]["checks"].get(key, {})
            cells.append("✓" if ch.get("match") else "✗")
        if key in LEGACY_CHECKS:  # a check that could not fail: no verdict shown
            notes.append(f"{key}: {LEGACY_CHECKS[key]}")
            cells = ["n/a (see below)"] * len(names)
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    lines.append(
        "| **passed** (required: direct, both engines; A and B outputs differ) | "
        + " | ".join("yes" if sizes[n]["correctness"]["passed"] else "NO" for n in names)
        + " |"
    )
    if notes:
        lines += [""] + [f"- {x}" for x in notes]

    missed = [
        f"{n}: {k} = {_fmt_x(t['value'])} (target {t['target']})"
        for n in names
        for k, t in sizes[n]["targets"].items()
        if t["met"] is False
    ]
    lines += ["", "## Missed targets", ""]
    lines += [f"- {x}" for x in missed] or ["none"]
    errors = [f"{n}: {e}" for n in names for e in sizes[n].get("errors", [])]
    if errors:
        lines += ["", "## Errors", ""] + [f"- {e[:300]}" for e in errors]
    return "\n".join(lines) + "\n"


def fmt_load(x: Any) -> str:
    return "n/a" if not x else "/".join(f"{v:.1f}" for v in x)
