"""What one worker answers for each phase of an update, as plain values that cross a process.

:class:`PushResult` is one worker's outcome. Workers never raise for an expected outcome: a
refusal (nothing written), a failure after writing started (rolled back or not) and a success
are all results, turned into plain dicts here; :func:`merged_error` makes the project's error of
every rank's refusals. The push's record built from every rank's result is
:class:`~weight_bridge.vllm.report.PushReport`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any

from ..checkpoint import CheckpointError
from ..direct import DirectReloadError, ReloadReport
from ..direct.errors import BaseVersionError
from ..direct.resolve import Relocation


class Phase(str, Enum):
    """THE lifecycle of an update on a worker, named once: the engine core drives every rank
    through these (:mod:`~weight_bridge.vllm.core.updates`), each worker runs them in one place
    (:meth:`~weight_bridge.vllm.worker.transaction.PushTransaction.run`, one method of the same
    name per phase), and every answer is that rank's :class:`PushResult`, whatever the phase
    raised. A client drives it with vLLM's own calls: ``start_weight_update`` (the update is
    claimed; ``ABANDON`` drops anything prepared), ``update_weights`` (``PREPARE``, then
    ``COMMIT`` or ``ABANDON``, then ``FAIL``/``ROLL_BACK`` where needed, in that one call),
    ``finish_weight_update`` (``SETTLE``)."""

    PREPARE = "prepare"  # check everything, plan every write: nothing written
    ABANDON = "abandon"  # a rank refused: drop what was prepared, no rank writes
    COMMIT = "commit"  # every rank prepared: write, read back, refresh
    FAIL = "fail"  # a check outside the workers failed after the write: record it
    ROLL_BACK = "roll_back"  # take back what was written, on every rank that wrote
    SETTLE = "settle"  # the update ended: release what no rollback needs any more


#: the phases in which a failure may find bits already written (the others write nothing)
WRITING_PHASES = frozenset({Phase.COMMIT, Phase.FAIL, Phase.ROLL_BACK})


@dataclass
class PushFailure:
    """A refusal or failure of one worker, as data (not an exception: it crosses process
    boundaries and becomes one in the caller, :func:`~weight_bridge.vllm.report.typed_error`):
    the error type's name,
    message, problems, phase.

    For a ``CheckpointError``, ``message`` is its problem, ``path`` its file and ``problems``
    names its tensor, if any.
    """

    type: str
    message: str
    problems: dict[str, str] = field(default_factory=dict)
    phase: str = "refused"  # "refused" (nothing written) or "after-write"
    path: str = ""

    @classmethod
    def of(cls, exc: BaseException, phase: str, reader: Any) -> PushFailure:
        """A worker's error as data, whatever its type; ``reader`` (the checkpoint's, if open)
        names each problem's shard file where the checkpoint has several. An exception the
        project did not type (a parser's ``ValueError``, a ``MemoryError``, a failed
        allocation) is a :class:`~weight_bridge.direct.DirectReloadError` naming its type."""
        if not isinstance(exc, (DirectReloadError, CheckpointError)):
            what = "refused" if phase == "refused" else "failed after writing started"
            return cls(
                "DirectReloadError", f"update {what}: {type(exc).__name__}: {exc}", {}, phase
            )
        if isinstance(exc, CheckpointError):
            problems = {exc.tensor: exc.problem} if exc.tensor else {}
            return cls("CheckpointError", exc.problem, problems, phase, exc.path)
        kind = type(exc).__name__ if isinstance(exc, BaseVersionError) else "DirectReloadError"
        problems = dict(exc.problems)
        if reader is not None and len(reader.files) > 1:
            for name, why in problems.items():
                where = reader.file_of(name)
                if where is not None:
                    problems[name] = f"{why} (in {where})"
        return cls(kind, exc.summary, problems, phase)


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
    delta: bool = False
    report: ReloadReport = field(default_factory=ReloadReport)
    undefined: str | None = None
    error: PushFailure | None = None
    rolled_back: str | None = None
    rollback_s: float | None = None
    served: list[str] = field(default_factory=list)
    version: str | None = None  # the checkpoint's own ``version`` metadata, if any
    written: bool = False
    # an adapter push: once prepared, the id whose slot it would take (``retiring``, checked
    # by the engine core against the requests it holds); once written, its id and the
    # bridge's ids still registered (:meth:`~weight_bridge.vllm.worker.adapter_writer
    # .AdapterWrite.landed`)
    adapter: dict[str, Any] | None = None

    @property
    def wrote(self) -> bool:
        """Whether this worker's weights changed (a success, or a failure after writing)."""
        return self.written and (self.error is None or self.error.phase == "after-write")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def unanswered(cls, phase: Phase, exc: BaseException) -> PushResult:
        """The answer of a rank whose worker raised ``exc`` instead of answering ``phase`` (it
        died, or its answer could not travel): in a phase that writes, its weights are not
        known, so it is undefined, naming why; otherwise a refusal."""
        writing = phase in WRITING_PHASES
        failure = PushFailure.of(exc, "after-write" if writing else "refused", None)
        why = f"a worker did not answer {phase.value}: {type(exc).__name__}: {exc}"
        return cls(rank=-1, error=failure, written=writing, undefined=why if writing else None)

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
            values["error"] = PushFailure(**values["error"])
        return cls(**values)


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
    wrong_base = all(r.error is not None and r.error.type == "BaseVersionError" for r in failed)
    kind = BaseVersionError if wrong_base else DirectReloadError
    return kind(_noted(head, note), problems)


def _noted(message: str, note: str | None) -> str:
    return f"{message}; {note}" if note else message


def shard_fingerprint_problems(results: list[PushResult]) -> dict[str, str]:
    """A delta's tensors held in shards (tensor parallelism): every rank reported its part of
    the fingerprint change, and the parts must add up to the trainer's full-tensor
    fingerprint. A tensor replicated on ``m`` ranks per element (more ranks than KV heads)
    counts each change ``m`` times, so ``m * (want - base)`` is checked; anything else
    (elements no rank holds, uneven replication) cannot be proven and is named."""
    parts: dict[str, list[list]] = {}
    for r in results:
        for name, part in r.report.shard_fingerprints.items():
            parts.setdefault(name, []).append(part)
    problems: dict[str, str] = {}
    for name, got in parts.items():
        want, base, _, _, total = got[0][:5]
        held = sum(int(p[3]) for p in got)
        if not base:
            problems[name] = "no fingerprint of the tensor served: push a keyframe"
        elif not total or held % total:
            problems[name] = f"the ranks hold {held} copies of its {total} changed elements"
        else:
            change = sum(int(p[2], 16) for p in got)
            expected = (held // total) * (int(want, 16) - int(base, 16))
            if (change - expected) % (1 << 64):
                problems[name] = (
                    "fingerprint after the delta, summed over the ranks, differs from the "
                    "trainer's: the engine's bits before it were not the delta's base"
                )
        if name not in problems and all(len(p) > 5 for p in got):  # readback="full"
            problems.update(_full_readback_problem(name, int(want, 16), got))
    return problems


def _full_readback_problem(name: str, want: int, got: list[list]) -> dict[str, str]:
    """``readback="full"`` of a sharded tensor: every rank's part of the full fingerprint,
    read back from its live shard, must add up to ``m`` times the trainer's (each element
    held ``m`` times), as one rank holding the tensor whole recomputes it."""
    held, numel = sum(int(p[6]) for p in got), int(got[0][7])
    if not numel or held % numel:
        return {name: f"the ranks hold {held} elements of its {numel}: it cannot be read back"}
    if (sum(int(p[5], 16) for p in got) - (held // numel) * want) % (1 << 64):
        return {
            name: "fingerprint of the full tensor read back, summed over the ranks, differs "
            "from the trainer's"
        }
    return {}
