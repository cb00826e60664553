"""Does the engine hold the trainer's weights, bit for bit? A check any client can run.

Why: a push reads every write back, but an operator of a shared server wants to ask the engine
itself, at any time, from the trainer's side of the wire: after a push, a rollback, someone
else's push. vLLM 0.34's ``POST /weight_checker`` hashes every *live* parameter, which on a CPU
engine is not the checkpoint's layout (fused projections, the linears beside their oneDNN packs,
tensor-parallel shards), so a trainer cannot compute its baseline from its own tensors. The
bridge's fingerprints can be: each worker fingerprints the full checkpoint tensor it holds, read
from live storage through the write map recorded at load (:func:`~weight_bridge.vllm.worker.
queries.worker_fingerprints`), and the trainer fingerprints its own tensor in the dtype the engine
holds it in (:func:`weight_bridge.exact.exact_fingerprint`). Both vLLMs, every client.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...delta.keyframes import castable_dtype
from ...exact import exact_fingerprint, format_fingerprint


def expected_fingerprints(
    tensors: Mapping[str, torch.Tensor], dtypes: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The trainer's side of the check: each tensor's exact fingerprint, cast first to the dtype
    the engine holds it in (``dtypes``: a complete push's ``PushReport.dtypes``; none: as given)."""
    out = {}
    for name, tensor in tensors.items():
        want = castable_dtype((dtypes or {}).get(name))
        t = tensor.detach().to(want) if want else tensor.detach()
        out[name] = format_fingerprint(exact_fingerprint(t))
    return out


def weight_mismatches(
    engine: Any, tensors: Mapping[str, torch.Tensor], dtypes: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Every tensor of ``tensors`` the engine does not hold bit for bit on every worker, naming
    why and which rank (empty: every worker that holds a tensor whole holds the trainer's bits).
    Each worker's copy is compared on its own: a replicated tensor wrong on one tensor-parallel
    rank is named with that rank, whatever the others hold. ``engine``: a client with
    ``fingerprints()`` (per worker, in rank order, what it holds whole); ``dtypes``: as
    :func:`expected_fingerprints` (default: the engine's last complete push's report)."""
    if dtypes is None:
        report = getattr(engine, "last_report", None)
        dtypes = getattr(report, "dtypes", None) or {}
    workers = list(engine.fingerprints())
    problems = {}
    for name, want in expected_fingerprints(tensors, dtypes).items():
        held = {rank: worker[name] for rank, worker in enumerate(workers) if name in worker}
        wrong = [
            f"rank {rank} holds fingerprint {got}" for rank, got in held.items() if got != want
        ]
        if not held:
            problems[name] = "no worker holds it whole (sharded, or not in the engine's layout)"
        elif wrong:
            problems[name] = f"{'; '.join(wrong)}, the trainer's tensor is {want}"
    return problems
