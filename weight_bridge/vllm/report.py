"""What one push wrote, how, and how long it took: the report every client returns, built from
every worker's :class:`~weight_bridge.vllm.outcome.PushResult`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..direct import ReloadReport
from .outcome import PushResult


@dataclass
class PushReport(ReloadReport):
    """What one push wrote, how, and how long it took: the direct-reload core's
    :class:`~weight_bridge.direct.ReloadReport` over every worker (rank 0's counts, the slowest
    worker's times, every worker's relocations and read-backs) plus what the push adds.

    ``mode``: ``direct``, ``auto`` (direct writes plus vLLM's layerwise processing of the
    modules in ``reprocessed``) or ``layerwise``; ``reason`` says which weights went which way.
    ``partial``: the checkpoint held a subset of tensors, written on top of its base version;
    ``delta``: it was a delta (``changed`` elements written; see
    :mod:`~weight_bridge.delta.format`). ``dtypes``: after a complete push, the dtype the
    engine holds each tensor in that a delta can patch (what a trainer casts to and diffs).
    ``served``: the checkpoints the engine serves afterwards, as its workers answered (a
    complete one, then partial ones on top of it). ``inflight``: how generation in flight was
    treated (``recompute``, ``keep``, ``drain``; see
    :mod:`~weight_bridge.vllm.clients.bridge_client`), and ``paused_s`` how long it was paused
    (None: not paused). ``elapsed_s``: the whole push, as the caller saw it.
    """

    checkpoint: str = ""
    version: Any = None
    mode: str = "direct"
    reason: str = ""
    workers: int = 1
    partial: bool = False
    delta: bool = False
    served: list[str] = field(default_factory=list)
    paused_s: float | None = None
    inflight: str | None = None

    @classmethod
    def merged(cls, results: list[PushResult], version: Any) -> PushReport:
        """One report for every rank's result."""
        first = results[0]
        reports = [r.report for r in results]
        return cls(
            tensors=first.report.tensors,
            bytes=first.report.bytes,
            direct=first.report.direct,
            refreshed=first.report.refreshed,
            reprocessed=first.report.reprocessed,
            verified_writes=sum(r.verified_writes for r in reports),
            relocations=[rel for r in reports for rel in r.relocations],
            preflight_s=max(r.preflight_s for r in reports),
            write_s=max(r.write_s for r in reports),
            refresh_s=max(r.refresh_s for r in reports),
            readback_s=max(r.readback_s for r in reports),
            threads=max(r.threads for r in reports),
            changed=first.report.changed,
            dtypes=dict(first.report.dtypes),
            checkpoint=first.checkpoint,
            version=version,
            mode=first.mode,
            reason=describe(first.report),
            workers=len(results),
            partial=first.partial,
            delta=first.delta,
            served=list(first.served),
        )


def describe(report: ReloadReport) -> str:
    """One line: how many weights went which way, and why."""
    if report.changed:
        return f"a delta: {report.changed} elements written in place at their resolved offsets"
    parts = [f"{report.direct} weights written directly"]
    if report.refreshed:
        kinds = sorted(set(report.refreshed.values()))
        parts.append(f"{len(report.refreshed)} modules refreshed ({', '.join(kinds)})")
    if report.reprocessed:
        first = sorted(report.reprocessed.items())[:2]
        why = "; ".join(f"{m}: {w}" for m, w in first)
        parts.append(f"{len(report.reprocessed)} modules re-processed by vLLM ({why})")
    return ", ".join(parts)
