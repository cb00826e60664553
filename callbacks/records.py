"""What the callback says about each sync: its history record, its metrics and its log line.

One job, kept apart from the wiring in :mod:`callbacks.weight_sync`: every consumer (``history``,
the trainer's loggers, the console) reads the same record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from weight_bridge.sync.adapter import AdapterPlan
from weight_bridge.sync.sender import Sent


def sync_record(
    step: int, sent: Sent, gap: float | None, adapter: AdapterPlan | None = None
) -> dict[str, Any]:
    """One history entry, from the sender's record of the sync
    (:class:`~weight_bridge.sync.sender.Sent`). ``delta``: the file held only what changed
    since the last push; ``changed``: the fraction of its tensors' elements that did (None for a
    keyframe); ``choice``: why it is a delta or not, with the costs measured so far
    (:meth:`~weight_bridge.delta.choice.DeltaChoice.describe`); ``push_s``: the push
    and, when on, the canary; ``adapter``: for a PEFT policy, whether its adapter or merged
    weights were sent, and why (:meth:`~weight_bridge.sync.adapter.AdapterPlan.describe`;
    None for any other policy)."""
    report = sent.report
    delta = sent.kind == "delta"
    return {
        "step": step,
        "checkpoint": str(sent.path),
        "bytes": sent.written.nbytes,
        "partial": sent.kind == "partial",
        "delta": delta,
        "changed": sent.written.changed if delta else None,
        "save_s": sent.save_s,
        "push_s": sent.push_s,
        "mode": getattr(report, "mode", None),
        "inflight": getattr(report, "inflight", None),
        "paused_s": getattr(report, "paused_s", None),
        "canary_gap": gap,
        "choice": dict(sent.choice),
        "adapter": adapter.describe() if adapter is not None else None,
    }


def sync_metrics(record: dict[str, Any]) -> dict[str, float]:
    """The ``weight_sync/*`` metrics of one sync."""
    metrics = {
        "weight_sync/save_s": record["save_s"],
        "weight_sync/push_s": record["push_s"],
        "weight_sync/bytes": float(record["bytes"]),
        "weight_sync/version": float(record["step"]),
        "weight_sync/delta": float(record["delta"]),
    }
    if record["changed"] is not None:
        metrics["weight_sync/changed_fraction"] = float(record["changed"])
    if record["canary_gap"] is not None:
        metrics["weight_sync/canary_gap"] = record["canary_gap"]
    return metrics


def sync_line(record: dict[str, Any], pushed: bool) -> str:
    """The one line rank zero logs."""
    path = Path(record["checkpoint"])
    mode = f", {record['mode']}" if pushed else ", no engine on rank 0"
    adapter = (record.get("adapter") or {}).get("sent") == "adapter"  # the mode says so
    mode += ", partial" if record["partial"] and not adapter else ""
    if record["delta"]:
        mode += f", delta ({100 * (record['changed'] or 0.0):.2f} % changed)"
    return (
        f"weight_sync: step {record['step']} -> {path.name} "
        f"({record['bytes'] / 2**20:.1f} MiB, save {record['save_s']:.2f} s, "
        f"push {record['push_s']:.2f} s{mode})"
    )
