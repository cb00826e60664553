"""Applying a delta in O(changed): scattered writes at the offsets a complete write showed.

Why: at RL learning rates a step changes a few percent of the engine's values; writing,
reading and copying the whole model for them is what a delta avoids. :func:`prepare_delta`
checks the whole delta against the layout recorded at load and the write map learned from the
last complete write (:mod:`.write_map`), and maps every changed element to the live element
it lands on (through fused qkv / gate_up storages, tensor-parallel shards, MoE expert slots,
tied embeddings), nothing written. :meth:`PreparedDelta.run` then, in order:

1. reads the *pre-images* of every element it will write (the undo log, O(changed));
2. writes the new values (a scatter per segment);
3. reads every changed element back (bit for bit);
4. updates each tensor's exact fingerprint (:mod:`weight_bridge.exact`) from its served one
   with the changed elements and checks it against the fingerprint the delta records for the
   full tensor (where this worker holds the tensor whole; a tensor-parallel shard reports its
   part to the engine core, which checks the sum), and with ``readback="full"`` recomputes
   every touched tensor's fingerprint from live storage;
5. refreshes the derived state of the modules written (the CPU oneDNN re-pack of every changed
   linear: vLLM's own processing, still O(model): ``refresh_s`` in the report).

A failure anywhere after the first write restores the pre-images (the undo log) and refreshes
again, so the model holds its previous bits exactly; the error says so. A tensor the map cannot
patch (its loader transforms it, or it comes in another dtype) is written whole through the
model's loader when the delta carries it dense, and refused by name when sparse: that is a
second writer (a direct reload), and :func:`prepare_delta` composes the two
(:class:`~.writer.Writers`: the scatters first; a failure of the loader's write before it wrote
undoes them, one after leaves the model undefined, for the engine to re-write from its files).
"""

from __future__ import annotations

import math
import time
from typing import TypeVar

import torch

from ..delta.format import Delta
from ..exact import exact_fingerprint, fingerprint_change
from ..layout import TensorSpec
from .delta_writes import Copy, Patch, cost, patch_of, write_patch
from .derived import refresh_derived_state
from .errors import DirectReloadError
from .parallel import run_split
from .plan import plan_direct_reload
from .positions import CHUNK
from .proof import module_of
from .record import require_layout
from .report import ReloadReport
from .session import prepare_direct_reload
from .snapshot import addresses
from .state import bridge_state
from .undo import UndoLog
from .validate import find_nonfinite, preflight
from .write_map import WriteMap, held_fingerprint, held_tensor, segment_fingerprint
from .writer import Writer, Writers

APPLYING = "a delta started writing and did not finish"
R = TypeVar("R")


def _results(results: list[R | BaseException]) -> list[R]:
    """The per-item results of :func:`~.parallel.run_split`, or the first failure raised."""
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]


class PreparedDelta:
    """The scatters of a delta, checked and mapped onto live storage, nothing written:
    :meth:`run` applies them (a :class:`~.writer.Writer` with pre-images)."""

    mode = "direct"

    def __init__(
        self,
        model: torch.nn.Module,
        patches: list[Patch],
        refresh: dict[str, str],
        wanted: dict[str, int],
        readback: str,
        preflight_s: float,
    ) -> None:
        self.model, self.patches = model, patches
        self.refresh, self.wanted, self.readback = refresh, wanted, readback
        self.preflight_s = preflight_s
        self.undo_log: UndoLog | None = None
        self._pre: list[list[torch.Tensor]] = []  # per patch, per scatter: the pre-images

    def run(self) -> ReloadReport:
        """Apply; on a failure after the first write, undo and raise
        :class:`DirectReloadError` saying the previous bits were restored."""
        started = time.perf_counter()
        state = bridge_state(self.model)
        if state.writing:
            raise DirectReloadError("a direct reload is already in progress on this model")
        report = ReloadReport(tensors=len(self.patches), preflight_s=self.preflight_s)
        undo = UndoLog(modules=dict(self.refresh), fingerprints=dict(state.fingerprints))
        was = state.undefined
        state.undefined, state.writing = was or APPLYING, True
        try:
            with torch.no_grad():
                self._write(undo, report)
                report.write_s = time.perf_counter() - started
                problems = self._check(report)
            if problems:
                raise DirectReloadError("the delta's read-back or fingerprints failed", problems)
            t0 = time.perf_counter()
            report.refreshed.update(refresh_derived_state(self.model, self.refresh))
            report.refresh_s = time.perf_counter() - t0
        except BaseException as exc:
            state.writing = False
            restored = self._restore(undo, was)
            if not isinstance(exc, Exception):
                raise  # an interrupt propagates as itself (the bits are restored)
            how = (
                "the undo log restored the previous bits"
                if restored
                else f"the weights are undefined: {state.undefined}"
            )
            if isinstance(exc, DirectReloadError):
                raise DirectReloadError(f"{exc.summary}; {how}", exc.problems) from exc
            raise DirectReloadError(
                f"a delta failed after writing started ({type(exc).__name__}: {exc}); {how}"
            ) from exc
        state.writing = False
        state.undefined = was
        state.fingerprints.update(self.wanted)
        self.undo_log = undo
        report.elapsed_s = self.preflight_s + time.perf_counter() - started
        return report

    def _write(self, undo: UndoLog, report: ReloadReport) -> None:
        """Every pre-image first (two names never share an element, but a re-read after a
        write would see it), all logged before the first write, then the scatters; each step
        split by tensor between this thread and the push's helper threads (:mod:`.parallel`:
        the CPUs a worker leaves to its engine core, which waits during a push)."""
        pre = run_split(self.patches, cost, lambda p: [s.read() for s in p.scatters])
        self._pre = _results(pre)
        for patch, olds in zip(self.patches, self._pre, strict=True):
            for scatter, old in zip(patch.scatters, olds, strict=True):
                scatter.log(undo, old)
                report.bytes += scatter.values.numel() * scatter.values.element_size()
                report.changed += scatter.values.numel()
        _results(run_split(self.patches, cost, write_patch))

    def _check(self, report: ReloadReport) -> dict[str, str]:
        """Read back every changed element, then the fingerprints (split as the writes)."""
        t0 = time.perf_counter()
        served = bridge_state(self.model).fingerprints

        def check(item: tuple[Patch, list[torch.Tensor]]) -> str | None:
            patch, olds = item
            if not all(scatter.landed() for scatter in patch.scatters):
                return "read back after the delta differs from its values"
            if patch.indices is None:
                return self._dense_fingerprint(patch, olds, served.get(patch.name), report)
            return self._fingerprint(patch, olds, served.get(patch.name), report)

        items = list(zip(self.patches, self._pre, strict=True))
        found = _results(run_split(items, lambda item: cost(item[0]), check))
        problems = {patch.name: why for (patch, _), why in zip(items, found, strict=True) if why}
        report.verified_writes += sum(len(p.scatters) for p in self.patches)
        report.readback_s = time.perf_counter() - t0
        return problems

    def _fingerprint(
        self, patch: Patch, olds: list[torch.Tensor], base: int | None, report: ReloadReport
    ) -> str | None:
        """Check the full tensor's fingerprint (whole here), or report this worker's part."""
        want = self.wanted[patch.name]
        assert patch.indices is not None
        n = patch.indices.numel()
        if len(olds) == 1 and patch.held[0].covers(n):  # one segment holds every element
            change, count = fingerprint_change(patch.indices, olds[0].cpu(), patch.values), n
        else:
            change, count = _held_change(patch, olds)
        if not patch.whole:
            self._shard_part(patch, base, change, count, n, report)
            return None
        if base is None:
            return "no fingerprint of the tensor served (push a keyframe)"
        if (base + change) % (1 << 64) != want:
            return (
                "fingerprint after the delta differs from the trainer's: the engine's bits "
                "before it were not the delta's base"
            )
        return self._full_readback(patch, want)

    def _full_readback(self, patch: Patch, want: int) -> str | None:
        """``readback="full"``: the tensor's fingerprint recomputed from live storage."""
        if self.readback != "full":
            return None
        full = held_tensor(bridge_state(self.model).write_map, patch.name, patch.shape)
        if exact_fingerprint(full) != want:
            return "fingerprint of the full tensor read back differs from the trainer's"
        return None

    def _dense_fingerprint(
        self, patch: Patch, olds: list[torch.Tensor], base: int | None, report: ReloadReport
    ) -> str | None:
        """A dense tensor: where this worker holds it whole, the delta's values (read back
        equal, segment by segment) must be the trainer's full tensor, whatever was there
        before; a shard reports its part of the change, weighed segment by segment at the
        checkpoint positions (no per-element positions: bounded temporaries)."""
        want = self.wanted[patch.name]
        if not patch.whole:
            change, count = 0, 0
            for copy, old in zip(patch.scatters, olds, strict=True):
                assert isinstance(copy, Copy)
                change += segment_fingerprint(copy.segment, copy.values)
                change -= segment_fingerprint(copy.segment, old)
                count += copy.segment.numel
            numel = math.prod(patch.shape)
            self._shard_part(patch, base, change & ((1 << 64) - 1), count, numel, report)
            return None
        if exact_fingerprint(patch.values) != want:
            return "fingerprint of the delta's values differs from the trainer's tensor"
        return self._full_readback(patch, want)

    def _shard_part(
        self,
        patch: Patch,
        base: int | None,
        change: int,
        count: int,
        total: int,
        report: ReloadReport,
    ) -> None:
        """This worker's part of a sharded tensor's fingerprint, for the engine core to sum
        over the ranks (:func:`~weight_bridge.vllm.outcome.shard_fingerprint_problems`)."""
        want = self.wanted[patch.name]
        report.shard_fingerprints[patch.name] = [
            f"{want:016x}",
            f"{(base or 0):016x}" if base is not None else "",
            f"{change:016x}",
            count,
            total,
        ]
        if self.readback == "full":  # this shard's part of the full tensor, read back
            part, held = held_fingerprint(bridge_state(self.model).write_map, patch.name)
            numel = math.prod(patch.shape)
            report.shard_fingerprints[patch.name] += [f"{part:016x}", held, numel]

    def _restore(self, undo: UndoLog, was: str | None) -> bool:
        """Undo what was written; whether the model holds its previous bits again (not when
        the undo failed)."""
        state = bridge_state(self.model)
        try:
            undo.undo(self.model)
        except Exception as failed:
            state.undefined = f"{APPLYING}; restoring its undo log failed too: {failed}"
            return False
        state.undefined = was
        return True


def _held_change(patch: Patch, olds: list[torch.Tensor]) -> tuple[int, int]:
    """The fingerprint change of the changed elements this worker holds, and how many: an
    element two segments hold counts once (with the first one's pre-image). Segment by segment,
    :data:`~.positions.CHUNK` indices at a time: no int64 copy of the indices held."""
    assert patch.indices is not None
    taken = torch.zeros(patch.indices.numel(), dtype=torch.bool)
    change, count = 0, 0
    for held, pre in zip(patch.held, olds, strict=True):
        pre = pre.cpu()
        done = 0  # this segment's pre-images used so far
        for start in range(held.lo, held.hi, CHUNK):
            end = min(start + CHUNK, held.hi)
            if held.mask is None:
                mine = torch.ones(end - start, dtype=torch.bool)
            else:
                mine = held.mask[start - held.lo : end - held.lo].cpu()
            fresh = mine & ~taken[start:end]
            mine_count = int(torch.count_nonzero(mine))
            old = pre[done : done + mine_count][fresh[mine]]
            new = patch.values[start:end][fresh]
            change += fingerprint_change(patch.indices[start:end][fresh], old, new)
            count += int(torch.count_nonzero(fresh))
            taken[start:end] |= mine
            done += mine_count
    return change & ((1 << 64) - 1), count


def _usable_map(model: torch.nn.Module, now: object) -> WriteMap:
    write_map = bridge_state(model).write_map
    if write_map is None:
        raise DirectReloadError(
            "this engine has made no complete direct write yet, so it does not know where a "
            "delta's elements go: push a complete checkpoint first (nothing was written)"
        )
    if write_map.addresses != now:
        raise DirectReloadError(
            "the model's storages changed since its last complete write: push a complete "
            "checkpoint (nothing was written)"
        )
    return write_map


def _specs(delta: Delta) -> dict[str, TensorSpec]:
    specs = {name: TensorSpec(tuple(t.shape), t.dtype) for name, t in delta.dense}
    specs.update({n: TensorSpec(s.shape, s.values.dtype) for n, s in delta.sparse.items()})
    return specs


def prepare_delta(
    model: torch.nn.Module, delta: Delta, *, check_finite: bool = True, readback: str = "sampled"
) -> Writer:
    """Check ``delta`` (decoded by :func:`~weight_bridge.delta.format.read_delta`; its
    base version is the caller's to check) and map it onto live storage; nothing is written.
    A refusal raises :class:`DirectReloadError` naming each tensor. The writer: the scatters,
    then a direct reload of what they cannot patch (:class:`~.writer.Writers`)."""
    started = time.perf_counter()
    state = bridge_state(model)
    layout = require_layout(model)
    now = addresses(model)
    write_map = _usable_map(model, now)
    problems = preflight(layout, _specs(delta), partial=True)
    if check_finite and not problems:
        sparse = [(n, s.values) for n, s in delta.sparse.items()]
        targets = {n: spec.dtype for n, spec in layout.checkpoint.items()}
        problems.update(find_nonfinite([*delta.dense, *sparse], targets))
    whole: list[tuple[str, torch.Tensor]] = []
    todo: list[tuple[str, tuple[int, ...], torch.Tensor | None, torch.Tensor]] = []
    for name, t in delta.dense:
        if name in write_map.segments and t.dtype == write_map.dtypes.get(name):
            todo.append((name, tuple(t.shape), None, t.reshape(-1)))  # every element
        else:
            whole.append((name, t))  # its loader transforms it, or a cast: written whole
    for name, sp in delta.sparse.items():
        why = write_map.unpatchable.get(name)
        if why is None and name not in write_map.segments:
            why = "the last complete write did not write it"
        held = write_map.dtypes.get(name)
        if name in problems:
            continue
        if why is not None:
            problems[name] = f"a sparse delta cannot patch it ({why}): send it dense"
        elif sp.values.dtype != held:
            problems[name] = f"its values are {sp.values.dtype}, the engine holds it in {held}"
        else:
            todo.append((name, sp.shape, sp.indices, sp.values))
    patches = _results(run_split(todo, lambda a: a[3].numel(), lambda a: patch_of(*a, write_map)))
    refresh = _refresh_of(model, [p.name for p in patches], write_map, problems, now)
    if problems:
        raise DirectReloadError("delta rejected (nothing was written)", problems)
    for patch in patches:  # a sparse tensor held whole: its served fingerprint, the base
        indexed = patch.indices is not None
        if indexed and patch.whole and (readback == "full" or patch.name not in state.fingerprints):
            served = held_tensor(write_map, patch.name, patch.shape)
            state.fingerprints[patch.name] = exact_fingerprint(served)
    writers: list[Writer] = []
    if whole:  # prepared first: its refusal comes before any write too
        writers.append(
            prepare_direct_reload(model, whole, check_finite=False, readback=readback, partial=True)
        )
    wanted = dict(delta.fingerprints)
    elapsed = time.perf_counter() - started
    writers.insert(0, PreparedDelta(model, patches, refresh, wanted, readback, elapsed))
    return Writers(model, writers)


def modules_to_refresh(model: torch.nn.Module, names: list[str]) -> dict[str, str]:
    """The derived state a delta's push refreshes after writing the checkpoint tensors
    ``names`` in place (module -> kind), for a writer outside the bridge to refresh the same;
    a tensor whose derived state no refresher knows raises :class:`DirectReloadError`."""
    now = addresses(model)
    problems: dict[str, str] = {}
    refresh = _refresh_of(model, names, _usable_map(model, now), problems, now)
    if problems:
        raise DirectReloadError("no refresh of the derived state of these tensors", problems)
    return refresh


def _refresh_of(
    model: torch.nn.Module,
    names: list[str],
    write_map: WriteMap,
    problems: dict[str, str],
    now: object,
) -> dict[str, str]:
    """The derived state to refresh after writing ``names`` (module -> kind); a write into a
    parameter the plan does not write directly (transformed by processing, derived state no
    refresher knows) is refused by name, as a complete push would refuse it."""
    plan = plan_direct_reload(model, frozenset(), now)  # type: ignore[arg-type]
    aliases = require_layout(model).aliases()  # a tied weight: every module that uses it
    refresh: dict[str, str] = {}
    for name in names:
        params = write_map.params.get(name, set())
        for param in sorted({a for p in params for a in aliases.get(p, [p])}):
            if param not in plan.targets:
                problems[name] = plan.problems.get(param, f"{param} is not writable")
                continue
            module = module_of(param)[0]
            if module in plan.refresh:
                refresh[module] = plan.refresh[module]
    return refresh
