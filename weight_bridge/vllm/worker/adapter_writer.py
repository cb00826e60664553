"""The adapter writer: a PEFT LoRA adapter written into the engine's LoRA slots, in place.

A push of an adapter sends a few MB (A and B of every targeted module) instead of the merged
linears. Each version gets a fresh LoRA id and a slot of its own (a free one, else the oldest
version's), filled by vLLM's own ``activate_adapter`` from a CPU copy this writer builds with
vLLM's bits (cast, then scaled: :func:`~weight_bridge.direct.adapter_slots.slot_tensors`); a
resident version is never rewritten under its id, so the copy vLLM re-fills an evicted slot
from and every prefix-cache key (vLLM keys KV by adapter name and path) stay that version's.

Like every writer (:class:`~weight_bridge.direct.writer.Writer`): everything is checked before
the first byte (the engine has LoRA, every tensor maps to a LoRA layer, shapes, ranks, dtypes,
finite after the cast and the scaling); ``run`` writes, reads back every row of the slot
bitwise, and on any failure restores the slot's pre-images and the manager's bookkeeping
(:class:`AdapterUndo`, also the transaction's rollback). An adapter push changes no base weight,
so the adapters stay registered across ``finish_weight_update``
(:func:`~weight_bridge.vllm.internals.lora.keep_adapters_once`). The engine core names the new
version by its id (:meth:`AdapterWrite.landed`), and the version leaves when its slot is taken.

First slice: a PEFT directory pushed by path, tensor parallel size 1.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ...checkpoint.adapter import (
    ADAPTER_CONFIG,
    AdapterConfig,
    adapter_part,
    is_adapter,
    is_adapter_dir,
    read_adapter_config,
)
from ...checkpoint.errors import CheckpointError
from ...direct import DirectReloadError, ReloadReport
from ...direct.adapter_slots import SlotPart, slot_map, slot_tensors
from ...direct.state import mark_undefined
from ...direct.undo import UndoLog
from ..internals import lora

MODE = "adapter"


def is_adapter_job(path: str, metadata: dict[str, str] | Any) -> bool:
    """Whether a push is an adapter's: marked so in its metadata, or a PEFT directory."""
    return is_adapter(metadata) or (os.path.isdir(path) and is_adapter_dir(path))


@dataclass
class AdapterUndo(UndoLog):
    """What takes an adapter write back: the slot's rows as they were (host copies) and the
    bookkeeping (the new id retired, the version it replaced registered, pinned and active
    again in the same slot)."""

    manager: Any = None
    slot: int = 0
    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    new_id: int = 0
    retired: Any = None

    def undo(self, model: torch.nn.Module) -> None:  # noqa: ARG002 (the protocol's signature)
        if self.new_id in lora.registered(self.manager):
            lora.retire(self.manager, self.new_id)
        if self.retired is not None and self.retired.id not in lora.registered(self.manager):
            lora.activate(self.manager, self.retired)
        views = dict(lora.slot_views(self.manager, self.slot))
        for name, row in self.rows.items():
            views[name].copy_(row)


class AdapterWrite:
    """A prepared adapter write (nothing written yet); see the module docstring."""

    mode = MODE

    def __init__(
        self,
        model: torch.nn.Module,
        manager: Any,
        copy: Any,
        expected: dict[str, tuple[int, torch.Tensor, torch.Tensor]],
        retiring: int | None,
        nbytes: int,
        tensors: int,
        preflight_s: float,
    ) -> None:
        self.model, self.manager, self.copy, self.expected = model, manager, copy, expected
        self.retiring, self.nbytes, self.tensors = retiring, nbytes, tensors
        self.preflight_s = preflight_s
        self.undo_log: UndoLog | None = None
        self.slot: int | None = None

    @property
    def lora_id(self) -> int:
        return int(self.copy.id)

    @classmethod
    def prepare(
        cls, model: torch.nn.Module, path: str, metadata: Any, items: list, finite: bool
    ) -> AdapterWrite:
        """Check the adapter in ``items`` against the engine's LoRA layers; refusals raise
        (:class:`DirectReloadError` / :class:`CheckpointError`), each problem by name."""
        started = time.perf_counter()
        manager = lora.manager_of(model)
        if manager is None:
            raise DirectReloadError(
                f"{path}: a LoRA adapter, but the engine was not started with "
                "enable_lora=True (nothing was written)"
            )
        config = _config(path, metadata)
        names = [name for name, _ in items]
        for name in names:
            if adapter_part(name) is None:
                raise CheckpointError(path, "not a LoRA matrix (lora_A / lora_B)", name)
        parse = lora.name_parser(manager)
        parts = slot_map(
            names, parse, lora.lora_layers(manager), lora.packed_layers(manager), _peft_module
        )
        tensors = dict(items)
        slices, expected = _slot_contents(manager, path, parts, tensors, config, finite)
        new_id = lora.next_id(manager)
        retiring = _retiring(manager, path)
        nbytes = sum(t.nbytes for t in tensors.values())
        copy = lora.cpu_copy(new_id, config.r, slices)
        elapsed = time.perf_counter() - started
        return cls(model, manager, copy, expected, retiring, nbytes, len(items), elapsed)

    def run(self) -> ReloadReport:
        """Write the slot, read it back; on failure restore it, then raise."""
        started = time.perf_counter()
        manager = self.manager
        slot = lora.free_slot(manager)
        if slot is None:
            slot = lora.slot_of(manager, self.retiring) if self.retiring is not None else None
        if slot is None:
            raise DirectReloadError("no LoRA slot to write (nothing was written)")
        # the slot's pre-images in host memory: the engine's device holds only the write
        rows = {
            name: view.detach().to("cpu", copy=True)
            for name, view in lora.slot_views(manager, slot)
        }
        retired = lora.registered(manager).get(self.retiring) if self.retiring else None
        undo = AdapterUndo(manager=manager, slot=slot, rows=rows, new_id=self.lora_id)
        undo.retired = retired
        try:
            if self.retiring is not None:
                lora.retire(manager, self.retiring)
            landed = lora.activate(manager, self.copy)
            if landed != slot:
                raise DirectReloadError(f"the adapter landed in slot {landed}, not {slot}")
            write_s = time.perf_counter() - started
            checked = self._read_back(slot)
        except Exception as exc:
            try:
                undo.undo(self.model)
            except Exception as failed:
                mark_undefined(self.model, f"restoring an adapter slot failed: {failed}")
                raise DirectReloadError(
                    f"adapter write failed ({exc}) and restoring the slot failed: {failed}"
                ) from exc
            if isinstance(exc, DirectReloadError):
                raise DirectReloadError(
                    f"{exc.summary}; the slot and the adapters were restored", exc.problems
                ) from exc
            raise DirectReloadError(
                f"adapter write failed: {type(exc).__name__}: {exc}; the slot and the "
                "adapters were restored"
            ) from exc
        self.slot, self.undo_log = slot, undo
        report = ReloadReport(tensors=self.tensors, bytes=self.nbytes, direct=self.tensors)
        report.preflight_s, report.write_s = self.preflight_s, write_s
        report.readback_s = time.perf_counter() - started - write_s
        report.verified_writes = checked
        report.elapsed_s = time.perf_counter() - started + self.preflight_s
        return report

    def landed(self) -> dict[str, Any]:
        """What the engine core records of a written adapter: its id, and every version the
        bridge pushed that is still registered here (the one whose slot it took is not)."""
        ours = sorted(i for i in lora.registered(self.manager) if i >= lora.FIRST_ID)
        return {"id": self.lora_id, "resident": ours}

    def _read_back(self, slot: int) -> int:
        """Every row of the slot, bitwise: the adapter's A and B where it has them, zeros
        everywhere else (ranks past its own, layers and slices it does not target)."""
        bad: dict[str, str] = {}
        checked = 0
        for name, view in lora.slot_views(self.manager, slot):
            want = torch.zeros_like(view)
            key = name.replace(".B[", ".A[")
            if key in self.expected:
                rank, a, b = self.expected[key]
                if ".A[" in name:
                    want[0, :rank, : a.shape[1]] = a
                else:
                    want[0, : b.shape[0], :rank] = b
            if not torch.equal(view, want.to(view.device)):
                bad[name] = "read back differs from what was written"
            checked += 1
        if bad:
            raise DirectReloadError("adapter slot read back wrong", bad)
        return checked


def _slot_contents(
    manager: Any,
    path: str,
    parts: dict[str, list[SlotPart | None]],
    tensors: dict[str, torch.Tensor],
    config: AdapterConfig,
    finite: bool,
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, tuple[int, Any, Any]]]:
    """Every targeted slice's A and B as the slot will hold them (cast, then scaled), keyed
    by the module vLLM packs (the CPU copy), and by slot row (the read-back); each misfit
    refused by name, nothing written."""
    packed = lora.packed_layers(manager)
    dtype, max_rank = lora.slot_dtype(manager), lora.max_rank(manager)
    problems: dict[str, str] = {}
    slices: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    expected: dict[str, tuple[int, Any, Any]] = {}
    for layer, layer_parts in parts.items():
        shapes = lora.layer_shapes(manager, layer)
        for part in (p for p in layer_parts if p is not None):
            why = _misfit(part, tensors, config, shapes[part.slice], max_rank)
            if why is None:
                scaling = config.scaling(part.peft_module)
                a, b = slot_tensors(tensors[part.a_name], tensors[part.b_name], scaling, dtype)
                if finite and not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                    why = f"NaN or Inf in A or B once cast to {dtype} and scaled"
            if why is not None:
                problems[part.a_name] = why
                continue
            slices[packed[layer][part.slice] if layer in packed else layer] = (a, b)
            expected[f"{layer}.A[{part.slice}]"] = (a.shape[0], a, b)
    if problems:
        raise DirectReloadError(f"{path}: adapter refused (nothing was written)", problems)
    return slices, expected


def _retiring(manager: Any, path: str) -> int | None:
    """The version whose slot the push takes (the oldest of the bridge's), or None where a
    slot is free; refused where every slot holds an adapter the bridge did not push."""
    if lora.free_slot(manager) is not None:
        return None
    ours = sorted(i for i in lora.slot_ids(manager) if i is not None and i >= lora.FIRST_ID)
    if not ours:
        raise DirectReloadError(
            f"{path}: every LoRA slot holds an adapter the bridge did not push "
            "(nothing was written)"
        )
    return ours[0]


def _config(path: str, metadata: Any) -> AdapterConfig:
    if os.path.isfile(os.path.join(path, ADAPTER_CONFIG)):
        return read_adapter_config(path)
    raise CheckpointError(path, f"no {ADAPTER_CONFIG}: an adapter push needs its PEFT config")


def _peft_module(name: str) -> str:
    part = adapter_part(name)
    assert part is not None
    return part[0]


def _misfit(
    part: SlotPart,
    tensors: dict[str, torch.Tensor],
    config: AdapterConfig,
    shape: tuple[int, int, int, int],
    max_rank: int,
) -> str | None:
    """Why A and B of ``part`` do not fit the slot slice (``(rank rows, in, out, rank
    cols)``), or None."""
    a, b = tensors[part.a_name], tensors[part.b_name]
    rank = config.rank(part.peft_module)
    _, size_in, size_out, _ = shape
    if not (a.is_floating_point() and b.is_floating_point()):
        return f"A {a.dtype} / B {b.dtype}: LoRA matrices are floating point"
    if rank > max_rank:
        return f"rank {rank} exceeds the engine's max_lora_rank {max_rank}"
    if tuple(a.shape) != (rank, size_in):
        return f"A has shape {tuple(a.shape)}, the slot takes ({rank}, {size_in})"
    if tuple(b.shape) != (size_out, rank):
        return f"B has shape {tuple(b.shape)}, the slot takes ({size_out}, {rank})"
    return None


def worker_adapters(worker: Any) -> dict[str, Any]:
    """The read-only ``"adapters"`` query: this worker's LoRA slots (``slots``: the id in each,
    None for a free one), the ids with a CPU copy (``registered``), and for each active id the
    exact fingerprint of every row of its slot (``prints``: what a cold start on the same PEFT
    directory must match bit for bit). Empty where the engine has no LoRA."""
    from ...exact import exact_fingerprint, format_fingerprint
    from ..internals.model import worker_model

    manager = lora.manager_of(worker_model(worker))
    if manager is None:
        return {}
    slots = lora.slot_ids(manager)
    prints = {
        str(lora_id): {
            name: format_fingerprint(exact_fingerprint(view.detach().cpu().contiguous()))
            for name, view in lora.slot_views(manager, slot)
        }
        for slot, lora_id in enumerate(slots)
        if lora_id is not None
    }
    return {"slots": slots, "registered": sorted(lora.registered(manager)), "prints": prints}
