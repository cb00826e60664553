"""The ``vllm-direct`` reload mode: vLLM's own direct reload (0.34+) does the write, the bridge
does what it lacks.

vLLM 0.34 ships direct reload itself (:mod:`weight_bridge.vllm.internals.vllm_direct`): it views
re-laid-out tensors back to their checkpoint layout, lets the model's loaders write in place and
re-runs post-load processing, addresses kept. Where it exists the bridge rides it instead of
writing through its own views, and keeps, around it:

* validation of the whole checkpoint before any write (names, shapes, dtypes, NaN/Inf, and that
  it is complete: vLLM's delivery contract, which vLLM does not check), and vLLM's own refusals
  (a processing step that replaced a parameter object) asked before the first byte;
* the read-back of every write vLLM's loaders made into a storage the bridge proved at load
  (before vLLM's ``finish`` re-processes anything), the check that every proven weight was
  written, and the audit (no address moved);
* rollback (the transaction re-writes the served chain the same way), labels stamped at commit
  and one update at a time (the engine core), partial and base checks (a partial checkpoint is
  refused here: vLLM's ``finish`` re-processes every module, so it needs them all).

CPU derived state is vLLM's where its ``finish`` re-derives it and the bridge's where it does
not (:func:`adopt_refreshers`), so a later push in any mode writes the same tensors.
"""

from __future__ import annotations

import time
from typing import Any, cast

import torch

from ...direct import DirectReloadError, ReloadReport
from ...direct.plan import ReloadPlan, plan_direct_reload
from ...direct.readback import ReadBack
from ...direct.record import require_layout
from ...direct.session import refresh_derived_state, unwritten_targets
from ...direct.snapshot import addresses
from ...direct.state import bridge_state, clear_undefined, mark_undefined, undefined_reason
from ...direct.undo import UndoLog
from ...direct.validate import validate_checkpoint
from ...layout import live_tensors, storage_ptr
from ..internals.vllm_direct import vllm_direct_begin, vllm_direct_finish
from .refresh import take_refreshers

WHAT = "vLLM's direct reload (post-load processing re-run)"


class VllmDirectWrite:
    """A complete checkpoint checked for vLLM's direct reload; :meth:`run` writes it (a
    :class:`~weight_bridge.direct.writer.Writer` without pre-images: a complete write is
    taken back from the files served before)."""

    mode = "vllm-direct"

    def __init__(self, model: torch.nn.Module, model_config: Any, items: list, readback: str):
        self.model, self.model_config, self.items = model, model_config, items
        self.readback = readback
        self.addresses = addresses(model)
        self.undo_log: UndoLog | None = None

    @classmethod
    def prepare(
        cls,
        model: torch.nn.Module,
        model_config: Any,
        items: list,
        *,
        finite: bool,
        partial: bool,
        refusal: str | None,
        readback: str,
    ) -> VllmDirectWrite:
        """Everything checked, nothing written: a refusal raises :class:`DirectReloadError`."""
        if partial:
            raise DirectReloadError(
                "a partial checkpoint cannot ride vLLM's direct reload, whose finish re-processes "
                "every module: push it with reload_mode='direct' (nothing was written)"
            )
        if refusal is not None:
            raise DirectReloadError(
                "vLLM's direct reload refuses this engine (nothing was written)",
                {"<vllm-direct>": refusal},
            )
        validate_checkpoint(require_layout(model), items, finite)  # complete, or refused
        return cls(model, model_config, items, readback)

    def run(self) -> ReloadReport:
        started = time.perf_counter()
        model = self.model
        if addresses(model) != self.addresses:
            raise DirectReloadError(
                "the model's storages changed since this reload was prepared (nothing was "
                "written): prepare it again"
            )
        was_undefined = undefined_reason(model)
        mark_undefined(model, f"{WHAT} started writing and did not finish")
        plan = plan_direct_reload(model)  # where the bridge proved each weight lives
        # every live storage: vLLM's loaders also write where the bridge keeps a source instead
        # (the CPU experts' prepacked buffers, re-derived by vLLM's finish)
        live = {storage_ptr(t) for _, t, _ in live_tensors(model)}
        readback = ReadBack(set(plan.storages) | live, self.readback)
        try:
            bad, readback_s = self._write(plan, readback)
        except Exception as exc:
            mark_undefined(model, f"{WHAT} failed: {type(exc).__name__}: {exc}")
            raise DirectReloadError(str(undefined_reason(model))) from exc
        refreshed = adopt_refreshers(model)
        write_s = time.perf_counter() - started - readback_s
        after = addresses(model)
        moved = {
            name: f"address/layout changed during vLLM's direct reload: {was} -> {after.get(name)}"
            for name, was in self.addresses.items()
            if after.get(name) != was
        }
        if moved:
            mark_undefined(model, f"{WHAT} moved storages")
            raise DirectReloadError(f"audit failed: {WHAT} moved storages", moved)
        if bad:
            mark_undefined(model, f"read-back after {WHAT} differs from the checkpoint")
            raise DirectReloadError(
                "read-back failed: the engine does not hold the checkpoint", bad
            )
        clear_undefined(model)
        return ReloadReport(
            tensors=len(self.items),
            bytes=sum(t.numel() * t.element_size() for _, t in self.items),
            refreshed=refreshed,
            reprocessed={"<all>": WHAT},
            verified_writes=len(readback.writes),
            write_s=write_s,
            readback_s=readback_s,
            elapsed_s=time.perf_counter() - started,
            recovered_from_undefined=was_undefined,
        )

    def _write(self, plan: ReloadPlan, readback: ReadBack) -> tuple[dict[str, str], float]:
        """vLLM's ``begin``, its loaders, then, before its ``finish`` re-processes anything, the
        read-back of every write into a storage the bridge proved at load and the check that
        every proven weight was written (vLLM's delivery contract); ``finish`` runs whatever
        happened. What differs or is missing, by name."""
        vllm_direct_begin(self.model)
        try:
            with readback:
                cast(Any, self.model).load_weights(readback.track(iter(self.items)))
            checked = time.perf_counter()
            bad = readback.verify()
            for name in unwritten_targets(self.model, plan, readback):
                bad[name] = f"not written by {WHAT} (the loader skipped it)"
            return bad, time.perf_counter() - checked
        finally:
            vllm_direct_finish(self.model, self.model_config, next(self.model.parameters()).device)


def adopt_refreshers(model: torch.nn.Module) -> dict[str, str]:
    """After vLLM's ``finish``: the derived state of every module with a refresher is current.

    Where post-load processing re-ran (the bridge's wrappers, :mod:`.refresh`, made a new
    refresher) the refresher proven at load is kept, its sources refreshed in place from the new
    one (addresses unchanged). Where vLLM did not re-run it (0.34 prepacks the CPU experts on the
    first load only: ``UnquantizedFusedMoEMethod._setup_kernel``), the live tensors still hold
    what the loaders wrote, in checkpoint layout: they become the sources and the bridge
    re-derives the state itself. Module -> kind re-derived."""
    state = bridge_state(model)
    fresh = take_refreshers(model)
    stale: dict[str, str] = {}
    with torch.no_grad():
        for name, kept in list(state.refreshers.items()):
            new = fresh.pop(name, None)
            if new is None:
                module = model.get_submodule(name)
                for key, source in kept.sources.items():
                    source.copy_(getattr(module, key))
                stale[name] = kept.kind
            elif type(kept) is type(new) and kept.sources.keys() == new.sources.keys():
                for key, source in new.sources.items():
                    kept.sources[key].copy_(source)
            else:
                state.refreshers[name] = new
                state.plan_cache = None
    for name, new in fresh.items():
        state.refreshers[name] = new
        state.plan_cache = None
    done = {name: r.kind for name, r in state.refreshers.items() if name not in stale}
    return {**done, **refresh_derived_state(model, stale)}
