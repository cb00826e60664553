"""``python -m weight_bridge.explain MODEL_DIR``: can this model be reloaded directly?

Starts a bridged engine on the model, runs a dry preflight of a direct reload in every worker
and prints one row per weight: reloadable in place, moved since load and resolved at its current
offset (from where to where), or not directly reloadable and why. Nothing is written. Run it
before trusting a new architecture or a new post-load processing path in an RL run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def format_plan(plan: dict[str, Any], rank: int = 0) -> str:
    """One worker's plan as a table (weights sorted by name) and a summary line."""
    rows = []
    for name, target in sorted(plan.get("targets", {}).items()):
        reloc = target.get("relocation")
        if reloc:
            status = (
                f"moved, resolved: storage {reloc['from_storage']:#x}+{reloc['from_offset']} "
                f"-> {reloc['to_storage']:#x}+{reloc['to_offset']}"
            )
        else:
            status = "direct (in place)"
        rows.append((name, "x".join(map(str, target["shape"])), status))
    for name, why in sorted(plan.get("problems", {}).items()):
        rows.append((name, "", f"NOT directly reloadable: {why}"))
    width = max((len(r[0]) for r in rows), default=4)
    lines = [f"worker {rank}: {plan.get('options')}", f"{'weight':<{width}}  {'shape':<12}  status"]
    lines += [f"{n:<{width}}  {s:<12}  {st}" for n, s, st in rows]
    moved = sum(1 for t in plan.get("targets", {}).values() if t.get("relocation"))
    lines.append(
        f"{len(plan.get('targets', {}))} reloadable ({moved} moved and resolved), "
        f"{len(plan.get('problems', {}))} not directly reloadable"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weight_bridge.explain", description=__doc__)
    parser.add_argument("model", help="Hugging Face-format model directory")
    parser.add_argument("--cpu-linear", default="repack", choices=["torch", "repack", "stock"])
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", action="store_true", help="print the raw plans as JSON")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from .vllm import ColocatedEngine

    with ColocatedEngine(
        args.model,
        cpu_linear=args.cpu_linear,
        tensor_parallel_size=args.tensor_parallel_size,
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=128,
        max_num_seqs=1,
    ) as engine:
        plans = engine.plan()
    if args.json:
        print(json.dumps(plans, indent=2, default=str))
    else:
        print("\n\n".join(format_plan(p, rank) for rank, p in enumerate(plans)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
