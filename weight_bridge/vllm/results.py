"""What crosses a process or HTTP boundary on an update: small dataclasses, built in one place.

* :class:`UpdateRequest`: the ``update_info`` of vLLM's ``update_weights`` for the bridge's
  backend (a checkpoint path and per-update choices), typed as the backend parses it.
* :class:`UpdateInProgressError`: a second update refused while one is active (who holds the
  engine's one update, since when, for which version), the same in every process and over HTTP.
* :class:`PushResult`: one worker's outcome. Workers never raise for an expected outcome: a
  refusal (nothing written), a failure after writing started (rolled back or not) and a success
  are all results, turned into plain dicts here; the engine core merges every rank's result
  into the error it raises (:func:`merged_error`) and :class:`~weight_bridge.vllm.ColocatedEngine`
  into its report or into the same error, so a caller sees the same type, message and problems
  in-process and multi-process, and over HTTP the same message.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..checkpoint import CheckpointError
from ..direct import DirectReloadError, ReloadReport
from ..direct.resolve import Relocation

__all__ = [
    "PushError",
    "PushReport",
    "PushResult",
    "UpdateInProgressError",
    "UpdateRequest",
    "describe",
    "merged_error",
]


@dataclass
class UpdateRequest:
    """``update_weights({"update_info": {...}})`` for the ``weight_bridge`` backend.

    ``checkpoint``: a safetensors file or a directory of shards, under the engine's checkpoint
    root (a relative path is taken relative to it). ``verify_hash`` / ``check_finite``: override
    the engine's options for this update. ``version``: the weight version the engine stamps on
    every output token computed with these weights, from the engine step that first runs them on
    (the engine core stamps it in the same call that writes them; default: the checkpoint's
    ``version`` metadata, else its file name). ``served_version``: the version the engine
    serves, filled in by the engine core (vLLM keeps it there); a partial checkpoint's
    ``base_version`` must equal it.
    """

    checkpoint: str
    verify_hash: bool | None = None
    check_finite: bool | None = None
    version: str | None = None
    served_version: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> UpdateRequest:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown or "checkpoint" not in data:
            raise ValueError(
                f"weight_bridge update_info takes {sorted(known)} (checkpoint required), "
                f"got {sorted(data)}"
            )
        return cls(**data)


@dataclass
class PushError:
    """A refusal or failure of one worker: the error type's name, message, problems, phase.

    For a ``CheckpointError``, ``message`` is its problem, ``path`` its file and ``problems``
    names its tensor, if any.
    """

    type: str
    message: str
    problems: dict[str, str] = field(default_factory=dict)
    phase: str = "refused"  # "refused" (nothing written) or "after-write"
    path: str = ""


@dataclass
class PushResult:
    """One worker's update in plain values: the core's report, or the error, and the state left.

    ``written``: whether this worker started writing (its commit ran); a worker that only
    prepared, or refused, wrote nothing and is never rolled back. ``rolled_back``: after a
    failure past the first write, what the rollback did (it re-wrote the served version, or
    failed too). ``served``: the checkpoints the worker's weights are made of afterwards (a
    complete one, then partial ones on top of it).
    """

    rank: int = 0
    checkpoint: str = ""
    mode: str = "direct"
    partial: bool = False
    report: ReloadReport = field(default_factory=ReloadReport)
    undefined: str | None = None
    error: PushError | None = None
    rolled_back: str | None = None
    rollback_s: float | None = None
    served: list[str] = field(default_factory=list)
    version: str | None = None  # the checkpoint's own ``version`` metadata, if any
    written: bool = False

    @property
    def wrote(self) -> bool:
        """Whether this worker's weights changed (a success, or a failure after writing)."""
        return self.written and (self.error is None or self.error.phase == "after-write")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def every_rank(cls, raw: Any) -> list[PushResult]:
        """Every rank's result, from what crossed the boundary (the engine core's utility
        ``weight_bridge_results``, its HTTP route, a ``collective_rpc``): a list of dicts."""
        return [cls.from_dict(r) for r in raw]

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


class UpdateInProgressError(RuntimeError):
    """``start_weight_update`` while another update is active: vLLM's engine takes one update at
    a time. ``since``: when the active update started (seconds since the epoch); ``version``:
    the version it is writing, once its ``update_weights`` named one; ``expires_in_s``: after
    how many more seconds without a call of its own the active update is abandoned and the next
    ``start_weight_update`` goes ahead (a trainer that died between start and finish). Over
    HTTP this is ``409 Conflict`` with the same message (:class:`~.http_client.HTTPClient` raises
    this type for it)."""

    def __init__(
        self,
        message: str,
        since: float | None = None,
        version: str | None = None,
        expires_in_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.since = since
        self.version = version
        self.expires_in_s = expires_in_s

    @classmethod
    def active(
        cls, since: float, version: str | None, expires_in_s: float
    ) -> UpdateInProgressError:
        import datetime

        when = datetime.datetime.fromtimestamp(since, datetime.timezone.utc)
        which = f" of version {version!r}" if version is not None else ""
        message = (
            f"a weight update{which} is active since {when.isoformat(timespec='milliseconds')}: "
            "one update at a time; retry after its finish_weight_update (it is abandoned if it "
            f"makes no call within {max(expires_in_s, 0.0):.1f} s)"
        )
        return cls(message, since, version, expires_in_s)

    def to_dict(self) -> dict[str, Any]:
        return {"since": self.since, "version": self.version, "expires_in_s": self.expires_in_s}


@dataclass
class PushReport(ReloadReport):
    """What one push wrote, how, and how long it took: the direct-reload core's
    :class:`~weight_bridge.direct.ReloadReport` over every worker (rank 0's counts, the slowest
    worker's times, every worker's relocations and read-backs) plus what the push adds.

    ``mode``: ``direct``, ``auto`` (direct writes plus vLLM's layerwise processing of the
    modules in ``reprocessed``) or ``layerwise``; ``reason`` says which weights went which way.
    ``partial``: the checkpoint held a subset of tensors, written on top of its base version.
    ``served``: the checkpoints the engine serves afterwards, as its workers answered (a
    complete one, then partial ones on top of it). ``inflight``: how generation in flight was
    treated (``recompute``, ``keep``, ``drain``; see :mod:`.client`), and ``paused_s`` how long
    it was paused (None: not paused). ``elapsed_s``: the whole push, as the caller saw it.
    """

    checkpoint: str = ""
    version: Any = None
    mode: str = "direct"
    reason: str = ""
    workers: int = 1
    partial: bool = False
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
            checkpoint=first.checkpoint,
            version=version,
            mode=first.mode,
            reason=describe(first.report),
            workers=len(results),
            partial=first.partial,
            served=list(first.served),
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


def merged_error(results: list[PushResult]) -> DirectReloadError | CheckpointError | None:
    """The project's own error for the workers' refusals and failures, every rank's problems
    merged (each naming its tensor, and its shard file where the checkpoint has several), the
    rollback's outcome appended; None if every worker succeeded."""
    failed = [r for r in results if r.error is not None]
    if not failed:
        return None
    first = failed[0]
    error = first.error
    assert error is not None
    note = next((r.rolled_back for r in results if r.rolled_back), None)
    if all(r.error is not None and r.error.type == "CheckpointError" for r in failed):
        tensor = next(iter(error.problems), None)
        return CheckpointError(error.path or first.checkpoint, _noted(error.message, note), tensor)
    head = error.message.splitlines()[0] if error.message else "direct reload failed"
    if first.checkpoint and not head.startswith(first.checkpoint):
        head = f"{first.checkpoint}: {head}"
    problems: dict[str, str] = {}
    for r in failed:
        assert r.error is not None
        problems.update(r.error.problems)
    return DirectReloadError(_noted(head, note), problems)


def _noted(message: str, note: str | None) -> str:
    return f"{message}; {note}" if note else message
