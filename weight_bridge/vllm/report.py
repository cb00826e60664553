"""The one record of a push: what it wrote, how, how long it took, or why it was refused.

The engine core builds it once from every worker's :class:`~weight_bridge.vllm.outcome.PushResult`
(:mod:`~weight_bridge.vllm.core.updates`); it crosses each boundary as those results and the
core's verdict (:meth:`PushReport.to_dict`: the engine-core utility ``weight_bridge_results`` to
the ``LLM``/``AsyncLLM`` process, the ``/weight_bridge/results`` route over HTTP), and every
figure is derived from them again on the other side, so the report is the same in process,
multi-process and over HTTP. :func:`typed_error` is the one function that turns a refused or
failed push's report into the error a caller sees (type, message and ``.problems`` alike
everywhere); the error carries its report (:func:`report_of`): a client never fetches it again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..checkpoint import CheckpointError
from ..direct import DirectReloadError, ReloadReport
from .outcome import PushResult, merged_error


@dataclass
class PushReport(ReloadReport):
    """What one push wrote, how, and how long it took: the direct-reload core's
    :class:`~weight_bridge.direct.ReloadReport` over every worker (rank 0's counts, the slowest
    worker's times, every worker's relocations and read-backs) plus what the push adds.

    ``version``: the label stamped with the write (None: nothing was). ``mode``: ``direct``,
    ``auto`` (direct writes plus vLLM's layerwise processing of the modules in ``reprocessed``),
    ``layerwise``, ``delta`` or ``adapter``; ``reason`` says which weights went which way.
    ``partial``: the checkpoint held a subset of tensors, written on top of its base version;
    ``delta``: it was a delta (``changed`` elements written; see
    :mod:`~weight_bridge.delta.format`). ``dtypes``: after a complete push, the dtype the
    engine holds each tensor in that a delta can patch (what a trainer casts to and diffs).
    ``served``: the checkpoints the engine serves afterwards, as its workers answered (a
    complete one, then partial ones on top of it). ``adapters``: the versions resident in the
    engine's LoRA slots afterwards (:mod:`~weight_bridge.vllm.core.adapters`). ``failed``: the
    error's message when the push was refused or failed; ``undefined``: why a rank's weights
    are half-written, if one's are. ``inflight``: how generation in flight was treated
    (``recompute``, ``keep``, ``drain``; see :mod:`~weight_bridge.vllm.clients.bridge_client`),
    and ``paused_s`` how long it was paused (None: not paused). ``elapsed_s``: the whole push,
    as the caller saw it. ``results``: every rank's own answer.
    """

    checkpoint: str = ""
    version: Any = None
    mode: str = "direct"
    reason: str = ""
    workers: int = 1
    partial: bool = False
    delta: bool = False
    served: list[str] = field(default_factory=list)
    adapters: dict[str, dict[str, Any]] = field(default_factory=dict)
    failed: str | None = None
    undefined: str | None = None
    paused_s: float | None = None
    inflight: str | None = None
    results: list[PushResult] = field(default_factory=list)

    @classmethod
    def of(
        cls,
        results: list[PushResult],
        version: str | None = None,
        failed: str | None = None,
        undefined: str | None = None,
        adapters: dict[str, dict[str, Any]] | None = None,
    ) -> PushReport:
        """The report of every rank's result and the engine core's verdict."""
        first = results[0] if results else PushResult()
        reports = [r.report for r in results] or [first.report]
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
            adapters=dict(adapters or {}),
            failed=failed,
            undefined=undefined,
            results=list(results),
        )

    def to_dict(self) -> dict[str, Any]:
        """What crosses a boundary: every rank's result and the core's verdict (the figures
        are derived from them again, :meth:`from_dict`)."""
        return {
            "results": [r.to_dict() for r in self.results],
            "version": self.version,
            "failed": self.failed,
            "undefined": self.undefined,
            "adapters": self.adapters,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> PushReport | None:
        """The report from what crossed the boundary (None: no update yet)."""
        if data is None:
            return None
        results = PushResult.every_rank(data["results"])
        return cls.of(
            results,
            data.get("version"),
            data.get("failed"),
            data.get("undefined"),
            data.get("adapters"),
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


def typed_error(report: PushReport | None) -> DirectReloadError | CheckpointError | None:
    """THE error of a refused or failed push, rebuilt from its report wherever the caller is
    (the engine core raising it, the ``LLM``/``AsyncLLM`` process, an HTTP client): every
    rank's problems merged (:func:`~weight_bridge.vllm.outcome.merged_error`), the report
    attached (:func:`report_of`). None for a successful push, or no report."""
    if report is None:
        return None
    error = merged_error(report.results)
    if error is None and report.failed is not None:
        error = DirectReloadError(report.failed)
    if error is not None:
        error.report = report  # type: ignore[union-attr]
    return error


def report_of(error: BaseException) -> PushReport | None:
    """The report a refusal or failure raised by :func:`typed_error` carries, else None."""
    report = getattr(error, "report", None)
    return report if isinstance(report, PushReport) else None
