"""What crosses the process boundary between a worker and the engine: small dataclasses.

Workers never raise for an expected outcome: a refusal (nothing written), a failure after
writing started, or a success all come back as a :class:`PushResult` turned into a plain dict
here, in one place; the engine turns it back and raises the project's own error types, so the
caller sees the same type, message and problems in-process and multi-process.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ..checkpoint import CheckpointError
from ..direct import DirectReloadError, ReloadReport, Relocation

__all__ = ["PushError", "PushReport", "PushResult", "describe", "raise_for_errors"]


@dataclass
class PushError:
    """A refusal or failure of one worker: the error type's name, message, problems, phase."""

    type: str
    message: str
    problems: dict[str, str] = field(default_factory=dict)
    phase: str = "refused"  # "refused" (nothing written) or "after-write"


@dataclass
class PushResult:
    """One worker's push in plain values: the core's report, or the error, and the state left."""

    rank: int = 0
    mode: str = "direct"
    report: ReloadReport = field(default_factory=ReloadReport)
    undefined: str | None = None
    error: PushError | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PushResult:
        known = {f.name for f in fields(cls)}
        missing = known - set(data)
        if missing:
            raise ValueError(f"a worker's push result lacks {sorted(missing)}")
        values = {k: v for k, v in data.items() if k in known}
        report = dict(values["report"])
        report["relocations"] = [Relocation(**r) for r in report["relocations"]]
        values["report"] = ReloadReport(**report)
        if values["error"] is not None:
            values["error"] = PushError(**values["error"])
        return cls(**values)


@dataclass
class PushReport:
    """What one push wrote, how, and how long it took (seconds; the slowest worker's).

    ``mode``: ``direct``, ``hybrid`` (direct writes plus vLLM's layerwise processing of the
    modules in ``reprocessed``) or ``layerwise``. ``direct``: weights written in place;
    ``refreshed``: module -> kind of derived state re-derived after the write;
    ``verified_writes``: writes read back and found equal to the checkpoint (every rank's).
    ``partial``: the checkpoint held a subset of tensors, written on top of its base version.
    """

    checkpoint: str
    version: Any
    mode: str
    reason: str = ""
    tensors: int = 0
    bytes: int = 0
    read_s: float = 0.0
    write_s: float = 0.0
    elapsed_s: float = 0.0
    direct: int = 0
    refreshed: dict[str, str] = field(default_factory=dict)
    reprocessed: dict[str, str] = field(default_factory=dict)
    verified_writes: int = 0
    refresh_s: float = 0.0
    readback_s: float = 0.0
    relocations: list[dict] = field(default_factory=list)
    workers: int = 1
    partial: bool = False

    @classmethod
    def merged(
        cls, results: list[PushResult], checkpoint: str, version: Any, partial: bool
    ) -> PushReport:
        """One report for every rank's result: rank 0's counts, the slowest rank's times,
        every rank's relocations and read-backs."""
        first = results[0].report
        reports = [r.report for r in results]
        return cls(
            checkpoint=checkpoint,
            version=version,
            mode=results[0].mode,
            reason=describe(first),
            tensors=first.tensors,
            bytes=first.bytes,
            direct=first.direct,
            refreshed=first.refreshed,
            reprocessed=first.reprocessed,
            verified_writes=sum(r.verified_writes for r in reports),
            read_s=max(r.preflight_s for r in reports),
            write_s=max(r.write_s for r in reports),
            refresh_s=max(r.refresh_s for r in reports),
            readback_s=max(r.readback_s for r in reports),
            relocations=[
                {**asdict(rel), "rank": r.rank} for r in results for rel in r.report.relocations
            ],
            workers=len(results),
            partial=partial,
        )


def describe(report: ReloadReport) -> str:
    """One line: how many weights went which way, and why."""
    parts = [f"{report.direct} weights written directly"]
    if report.refreshed:
        kinds = sorted(set(report.refreshed.values()))
        parts.append(f"{len(report.refreshed)} modules refreshed ({', '.join(kinds)})")
    if report.reprocessed:
        first = sorted(report.reprocessed.items())[:2]
        why = "; ".join(f"{m}: {w}" for m, w in first)
        parts.append(f"{len(report.reprocessed)} modules re-processed by vLLM ({why})")
    return ", ".join(parts)


def raise_for_errors(
    results: list[PushResult], checkpoint: str, where: Mapping[str, Path | None]
) -> None:
    """Raise the project's own error for the workers' refusals, every rank's problems merged.

    ``where`` (tensor -> shard file) names the file of each problem of a sharded checkpoint.
    """
    errors = [r.error for r in results if r.error is not None]
    if not errors:
        return
    first = errors[0]
    if first.type == "CheckpointError":
        raise CheckpointError(checkpoint, first.message.removeprefix(f"{checkpoint}: "))
    head = first.message.splitlines()[0] if first.message else "direct reload failed"
    if not head.startswith(checkpoint):
        head = f"{checkpoint}: {head}"
    problems: dict[str, str] = {}
    for error in errors:
        for name, why in error.problems.items():
            file = where.get(name)
            named = file is not None and str(file) != checkpoint
            problems[name] = f"{why} (in {file})" if named else why
    raise DirectReloadError(head, problems)
