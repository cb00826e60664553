"""Each lever of the default CPU push on its own, on one live engine, in the same rounds.

Interleaved round-robin with the default push (``direct``) of the same checkpoints:

* ``direct_glibc_malloc``: the worker process switched to glibc's default allocator
  parameters (``mallopt``, fixed thresholds of 128 KiB) for an untimed push and the timed one,
  then switched back with two untimed pushes: what :mod:`weight_bridge.vllm.worker.allocator` buys
  in steady state (a switch alone would time the first push after it);
* ``direct_cold_plan``: the plan cached on the model dropped before the push (untimed), so
  the push resolves and proves every weight again: what the plan cache buys;
* ``tiny``: a partial push of one small tensor (the final norm, applied on the version
  served): the fixed cost of a push (RPCs, headers, plan lookup, address audit, prefix-cache
  reset);
* ``overlap_probe_*``: the overlap lever, which the push does not use, probed inside the worker
  on the engine's own packed linears (``bench_overlap``): each linear's weight written and
  re-packed one after the other, against the re-pack of linear i in a second thread while
  linear i+1 is written.

Besides: whether a push hits the plan cache (the cached plan is the same object before and
after it), and the median cost of one address audit inside the worker.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .engines import push, rpc
from .stats import Rounds

__all__ = ["measure_levers", "tiny_files"]

_TINY = "model.norm.weight"


def tiny_files(a: Path, tag: str) -> Callable[[str], Path]:
    """``file(base)``: a partial checkpoint of the final norm (from A) on version ``base``,
    written on first use (untimed), in a directory of ``tag``'s own."""
    from weight_bridge.checkpoint import BASE_VERSION_KEY, CheckpointReader, save_checkpoint

    with CheckpointReader(a / "model.safetensors") as reader:
        tensor = {n: t.clone() for n, t in reader.tensors() if n.endswith(_TINY)}
    root = a.parent / f"tiny-{tag}-{a.name}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)

    def file(base: str) -> Path:
        path = root / f"tiny-on-{base}.safetensors"
        if not path.exists():
            save_checkpoint(tensor, path, {BASE_VERSION_KEY: base})
        return path

    return file


def _with_allocator(engine: Any, file: Path, other: Path, rep: int) -> dict[str, float]:
    """A push with the worker's allocator switched to glibc's defaults, after one untimed push
    in that state (the previous one, with buffers kept, left its heap to reuse); the
    allocator switched back afterwards, and one untimed push in that state again, so the next
    method meets the steady state of the default push."""
    rpc_all(engine, "bench_allocator", "default")
    try:
        push(engine, other, f"{rep}-warm")
        return push(engine, file, rep)
    finally:
        rpc_all(engine, "bench_allocator", "kept")
        push(engine, other, f"{rep}-rewarm")
        push(engine, file, rep)


def rpc_all(engine: Any, method: str, *args: Any) -> list:
    return list(engine.llm.collective_rpc(method, args=args))


def measure_levers(
    engine: Any, a: Path, b: Path, reps: int, log: Callable[[str], None]
) -> dict[str, Any]:
    """The rounds described in the module docstring; the engine ends on a complete push."""
    fa, fb = a / "model.safetensors", b / "model.safetensors"
    tiny = tiny_files(a, "levers")

    def file(rep: int) -> Path:
        return fb if rep % 2 == 0 else fa

    def cold_plan(rep: int) -> dict[str, float]:
        rpc_all(engine, "bench_plan_cache", True)
        return push(engine, file(rep), rep)

    def tiny_push(rep: int) -> dict[str, float]:
        version = str(engine.version)
        return push(engine, tiny(version), version)

    methods: dict[str, Callable[[int], Any]] = {
        "direct": lambda rep: push(engine, file(rep), rep),
        "direct_glibc_malloc": lambda rep: _with_allocator(engine, file(rep), file(rep + 1), rep),
        "direct_cold_plan": cold_plan,
        "tiny": tiny_push,
        "overlap_probe_sequential": lambda rep: rpc(engine, "bench_overlap", False),
        "overlap_probe_overlapped": lambda rep: rpc(engine, "bench_overlap", True),
    }
    states = rpc_all(engine, "bench_allocator", "kept")
    log(f"  levers ({reps} x {len(methods)}; allocator {states})")
    rounds = Rounds()
    rounds.run(methods, reps)
    out: dict[str, Any] = {name: rounds.result(name) for name in methods}
    out["allocator_state"] = states
    before = rpc_all(engine, "bench_plan_cache")
    push(engine, fa, "levers")
    out["plan_cache_hit"] = rpc_all(engine, "bench_plan_cache") == before and None not in before
    out["audit_s"] = rpc(engine, "bench_audit_s")
    return out
