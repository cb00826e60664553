"""Partial pushes: cost against the changed fraction, side by side with a full push.

On the multi-process engine, interleaved round-robin with a full push of B:

* ``quarter``: the top layers (from the last one down) until a quarter of the checkpoint's
  bytes, plus the final norm: what training with frozen lower layers sends;
* ``lora_attention``: every attention projection (q, k, v, o), as the callback sends the
  merged weights of LoRA adapters on attention only.

Each partial checkpoint names the version it applies on; since the round-robin order rotates,
one file per (kind, base) is written before its first timed push (untimed). Correctness: full
B, then the quarter, then the attention push, against a cold start on the equivalent full
checkpoint (B with those tensors from A).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .engines import greedy, start_engine
from .stats import Rounds, compare, ratio

__all__ = ["measure_partial"]

_LAYER = re.compile(r"\.layers\.(\d+)\.")
_ATTENTION = re.compile(r"\.self_attn\.[qkvo]_proj\.weight$")


def _selections(tensors: dict[str, Any]) -> dict[str, list[str]]:
    size = {n: t.numel() * t.element_size() for n, t in tensors.items()}
    total = sum(size.values())
    layers: dict[int, list[str]] = {}
    for name in tensors:
        m = _LAYER.search(name)
        if m:
            layers.setdefault(int(m.group(1)), []).append(name)
    quarter = [n for n in tensors if n.endswith("model.norm.weight")]
    for index in sorted(layers, reverse=True):
        if sum(size[n] for n in quarter) >= total / 4:
            break
        quarter += layers[index]
    return {"quarter": quarter, "lora_attention": [n for n in tensors if _ATTENTION.search(n)]}


def measure_partial(
    engine: Any, a: Path, b: Path, workdir: Path, reps: int, log: Callable[[str], None]
) -> dict[str, Any]:
    """Push time and bytes of a full push and of each partial kind; parity of a chain."""
    from weight_bridge.checkpoint import BASE_VERSION_KEY, CheckpointReader, save_checkpoint

    fb = b / "model.safetensors"
    with CheckpointReader(a / "model.safetensors") as reader:
        a_tensors = {n: t.clone() for n, t in reader.tensors()}
    kinds = _selections(a_tensors)
    files: dict[tuple[str, str], Path] = {}
    root = workdir / f"partial-{a.name}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)

    def partial_file(kind: str, base: str) -> Path:
        if (kind, base) not in files:
            path = root / f"{kind}-on-{base}.safetensors"
            chosen = {n: a_tensors[n] for n in kinds[kind]}
            save_checkpoint(chosen, path, {BASE_VERSION_KEY: base, "version": kind})
            files[(kind, base)] = path
        return files[(kind, base)]

    def push(kind: str) -> dict[str, float]:
        if kind == "full":
            report = engine.push(fb, version="full")
        else:
            report = engine.push(partial_file(kind, str(engine.version)))
        return {
            "elapsed_s": report.elapsed_s,
            "write_s": report.write_s,
            "refresh_s": report.refresh_s,
            "bytes": float(report.bytes),
            "tensors": float(report.tensors),
            "refreshed": float(len(report.refreshed)),
        }

    methods = {kind: (lambda rep, kind=kind: push(kind)) for kind in ("full", *kinds)}
    engine.push(fb, version="full")
    for kind in kinds:  # warm the page cache of every file before timing
        push(kind)
    log(f"  partial pushes ({reps} x {len(methods)})")
    rounds = Rounds()
    rounds.run(methods, reps)
    out: dict[str, Any] = {name: rounds.result(name) for name in methods}
    full = out["full"]
    for kind in kinds:
        out[kind]["bytes_vs_full"] = ratio(out[kind]["bytes"]["median"], full["bytes"]["median"])
        out[kind]["time_vs_full"] = ratio(out[kind]["median"], full["median"])

    log("  partial chain against a cold start on the equivalent full checkpoint")
    engine.push(fb, version="full")
    engine.push(partial_file("quarter", "full"))
    engine.push(partial_file("lora_attention", "quarter"))
    pushed = greedy(engine)
    equivalent = root / "equivalent"
    shutil.copytree(b, equivalent, ignore=shutil.ignore_patterns("*.safetensors"))
    with CheckpointReader(fb) as reader:
        tensors = {n: t.clone() for n, t in reader.tensors()}
    tensors.update({n: a_tensors[n] for kind in kinds.values() for n in kind})
    save_checkpoint(tensors, equivalent / "model.safetensors")
    cold = start_engine(equivalent)
    try:
        out["parity_vs_cold"] = compare(pushed, greedy(cold))
    finally:
        cold.close()
    out["what"] = {kind: f"{len(names)} tensors" for kind, names in kinds.items()}
    return out
