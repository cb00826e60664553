"""What a client may ask every worker besides an update, answered by
:func:`~weight_bridge.vllm.worker.backend.call_backend`'s read-only actions
(:data:`~weight_bridge.vllm.worker.backend.QUERIES`): a dry-run plan, the addresses of the weights,
why the weights are undefined.

Each runs in a worker (each tensor-parallel rank); only small plain values cross the process
boundary.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from ...direct import ReloadPlan
from ...direct.proof import module_of
from ...direct.snapshot import addresses
from ...direct.state import bridge_state, undefined_reason
from ...direct.write_map import held_tensor
from ...exact import exact_fingerprint, format_fingerprint
from ..internals.model import transfer_engine, worker_model
from ..internals.objects import config_of
from ..options import bridge_options
from .writers import push_plan


def _pushes_with(worker: Any) -> str:
    """The reload mode the worker's backend pushes with now (its session's, else the engine's
    options'), ``direct`` if it runs none."""
    transaction = getattr(transfer_engine(worker), "transaction", None)
    options = getattr(transaction, "options", None) or bridge_options(config_of(worker))
    return getattr(options, "reload_mode", None) or "direct"


def worker_plan(worker: Any, mode: str | None = None) -> dict:
    """A dry run of a push in ``mode`` (None: the mode the worker pushes with), from the push's
    own plan (:func:`~weight_bridge.vllm.worker.writers.push_plan`): the mode it would run
    in, per name its direct write target and refresh, the modules re-processed, the refusals
    (in ``layerwise`` mode no direct target: vLLM's reload writes every weight)."""
    model = worker_model(worker)
    state = bridge_state(model)
    if state.layout is None:
        return {"error": "no checkpoint layout recorded: was the engine bridged?"}
    chosen = push_plan(model, mode or _pushes_with(worker))
    plan = chosen.plan
    proof = state.proof
    options = bridge_options(config_of(worker))
    return {
        "mode": chosen.mode,
        "targets": _targets(plan) if plan is not None else {},
        "problems": dict(plan.problems) if plan is not None else dict(chosen.wrong or {}),
        "reprocess": dict(plan.reprocess) if plan is not None else {},
        "transformed": dict(proof.transformed) if proof else {},
        "derived": dict(proof.derived) if proof else {},
        "noted": dict(proof.noted) if proof else {},
        "options": asdict(options) if options is not None else None,
    }


def _targets(plan: ReloadPlan) -> dict[str, dict]:
    relocated = {r.name: asdict(r) for r in plan.relocations}
    return {
        name: {
            "shape": list(t.view.shape),
            "relocation": relocated.get(name),
            "refresh": plan.refresh.get(module_of(name)[0]),
        }
        for name, t in plan.targets.items()
    }


def worker_addresses(worker: Any) -> dict[str, tuple]:
    """Every parameter/buffer name -> (data_ptr, shape, stride, dtype)."""
    return addresses(worker_model(worker))


def worker_undefined(worker: Any) -> str | None:
    """Why this worker's weights are half-written, or None."""
    return undefined_reason(worker_model(worker))


def worker_fingerprints(worker: Any) -> dict[str, str]:
    """Checkpoint name -> the exact fingerprint (:mod:`weight_bridge.exact`) of the full tensor
    this worker holds, read from live storage through the write map, for every tensor it holds
    whole: what a trainer compares with its own cast to prove the engine holds its bits."""
    model = worker_model(worker)
    state = bridge_state(model)
    write_map = state.write_map
    if write_map is None or state.layout is None:
        return {}
    out = {}
    for name in write_map.segments:
        shape = state.layout.checkpoint[name].shape
        numel = 1
        for n in shape:
            numel *= n
        if write_map.whole(name, numel):
            out[name] = format_fingerprint(exact_fingerprint(held_tensor(write_map, name, shape)))
    return out
