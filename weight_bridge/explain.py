"""``python -m weight_bridge.explain MODEL_DIR``: can this model be reloaded directly?

Starts a bridged engine on the model, runs a dry run of a push in every worker (nothing is
written) and prints one row per weight:

* ``direct (in place)`` / ``moved, resolved: storage A+off -> B+off``: written directly;
* ``... + refresh <kind>``: written directly, then the derived state named is re-derived;
* ``re-processed by vLLM layerwise: <why>`` (``--mode auto``): its module is handed to vLLM's
  per-layer processing because processing transformed it or derived state from it;
* ``NOT directly reloadable: <why>``: refused by name (transformed values, derived state no
  refresher knows, emptied storage...).

Run it before trusting a new architecture or a new post-load processing path in an RL run.

``python -m weight_bridge.explain CHECKPOINT`` on a delta checkpoint (a sync's file when the
trainer sends what changed) describes it instead, with no engine: its base and own version,
and per tensor whether it is sparse or dense, how many elements changed, its bytes and the
fingerprint of the full tensor it produces.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from .checkpoint import CheckpointReader
from .direct.proof import module_of


def _status(target: dict[str, Any]) -> str:
    reloc = target.get("relocation")
    if reloc:
        status = (
            f"moved, resolved: storage {reloc['from_storage']:#x}+{reloc['from_offset']} "
            f"-> {reloc['to_storage']:#x}+{reloc['to_offset']}"
        )
    else:
        status = "direct (in place)"
    if target.get("refresh"):
        status += f" + refresh {target['refresh']}"
    return status


def format_plan(plan: dict[str, Any], rank: int = 0) -> str:
    """One worker's plan as a table (weights sorted by name) and a summary line."""
    targets = plan.get("targets", {})
    rows = [
        (name, "x".join(map(str, t["shape"])), _status(t)) for name, t in sorted(targets.items())
    ]
    reprocess = plan.get("reprocess", {})
    for module, why in sorted(reprocess.items()):
        rows.append((f"{module}.*", "", f"re-processed by vLLM layerwise: {why}"))
    for name, why in sorted(plan.get("problems", {}).items()):
        rows.append((name, "", f"NOT directly reloadable: {why}"))
    width = max((len(r[0]) for r in rows), default=4)
    lines = [f"worker {rank}: {plan.get('options')}", f"{'weight':<{width}}  {'shape':<12}  status"]
    lines += [f"{n:<{width}}  {s:<12}  {st}" for n, s, st in rows]
    for module, items in sorted(plan.get("noted", {}).items()):
        lines.append(f"noted, not blocking (no weight there): {module}: {', '.join(items)}")
    moved = sum(1 for t in targets.values() if t.get("relocation"))
    refreshed = {module_of(n)[0] for n, t in targets.items() if t.get("refresh")}
    lines.append(
        f"{len(targets)} reloadable ({moved} moved and resolved, {len(refreshed)} modules "
        f"refreshed), {len(reprocess)} modules re-processed, "
        f"{len(plan.get('problems', {}))} not directly reloadable"
    )
    return "\n".join(lines)


def describe_delta(reader: CheckpointReader) -> str:
    """A delta checkpoint as a table: one row per tensor, then totals."""
    delta = reader.delta()
    rows = []
    for name, t in delta.dense:
        rows.append((name, "dense", t.numel(), t.numel(), t.nbytes, delta.fingerprints[name]))
    for name, sp in delta.sparse.items():
        stored = sum(reader.tensor(k).nbytes for k in reader.specs() if k.startswith(name + "@"))
        n = sp.indices.numel()
        rows.append((name, "sparse", n, sp.numel, stored, delta.fingerprints[name]))
    width = max((len(r[0]) for r in rows), default=6)
    lines = [
        f"delta {reader.path}: version {delta.version!r} on top of base {delta.base!r}",
        f"{'tensor':<{width}}  kind    changed / elements   bytes       fingerprint",
    ]
    for name, kind, changed, numel, nbytes, fp in sorted(rows):
        share = f"{changed} / {numel} ({100 * changed / max(numel, 1):.2f} %)"
        lines.append(f"{name:<{width}}  {kind:<6}  {share:<20} {nbytes:<11} {fp:016x}")
    changed = sum(r[2] for r in rows)
    numel = sum(r[3] for r in rows)
    lines.append(
        f"{len(rows)} tensors ({len(delta.sparse)} sparse, {len(delta.dense)} dense), "
        f"{changed} of {numel} elements changed, {reader.nbytes} bytes"
    )
    return "\n".join(lines)


def _delta_at(path: str) -> CheckpointReader | None:
    """An open reader if ``path`` is a delta checkpoint, else None (a model directory)."""
    try:
        reader = CheckpointReader(path)
    except Exception:
        return None
    if reader.is_delta:
        return reader
    reader.close()
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weight_bridge.explain", description=__doc__)
    parser.add_argument("model", help="Hugging Face-format model directory, or a delta checkpoint")
    parser.add_argument("--cpu-linear", default="repack", choices=["torch", "repack", "stock"])
    parser.add_argument("--mode", default="direct", choices=["direct", "auto"])
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        help="module:function to run in every engine process (registers custom architectures)",
    )
    parser.add_argument("--json", action="store_true", help="print the raw plans as JSON")
    args = parser.parse_args(argv)
    reader = _delta_at(args.model)
    if reader is not None:
        with reader:
            print(describe_delta(reader))
        return 0
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from .vllm.clients.colocated import ColocatedEngine

    with ColocatedEngine(
        args.model,
        cpu_linear=args.cpu_linear,
        tensor_parallel_size=args.tensor_parallel_size,
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=128,
        max_num_seqs=1,
        plugins=args.plugin,
    ) as engine:
        plans = engine.plan(args.mode)
    if args.json:
        print(json.dumps(plans, indent=2, default=str))
    else:
        print("\n\n".join(format_plan(p, rank) for rank, p in enumerate(plans)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
