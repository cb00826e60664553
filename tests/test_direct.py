"""Direct reload core on toy modules with real tensors; the reference is always a cold start."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers import (
    IDS,
    A,
    B,
    Toy,
    cold_start,
    load_by_name,
    set_storage,
    snapshot_bytes,
    toy_checkpoint,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import weight_bridge.direct.plan as plan_mod
import weight_bridge.direct.proof as proof_mod
import weight_bridge.direct.resolve as resolve_mod
from weight_bridge.direct import (
    DirectReloadError,
    direct_reload,
    direct_reload_session,
    prepare_direct_reload,
    record_checkpoint_layout,
)
from weight_bridge.direct.state import bridge_state, undefined_reason
from weight_bridge.layout import TensorSpec, live_tensors


def move_proj_next_to_other(model: Toy) -> None:
    """The upstream bug's shape: proj.weight moves into a fused buffer, after other.weight."""
    o, p = model.other.weight, model.proj.weight
    fused = torch.empty(o.numel() + p.numel())
    fused[: o.numel()].copy_(o.detach().reshape(-1))
    fused[o.numel() :].copy_(p.detach().reshape(-1))
    set_storage(o, fused, 0, o.shape, o.stride())
    set_storage(p, fused, o.numel(), p.shape, p.stride())


def logical_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t, _ in live_tensors(model)}


def addresses(model: nn.Module) -> dict[str, tuple]:
    return {n: (t.data_ptr(), tuple(t.shape), tuple(t.stride())) for n, t, _ in live_tensors(model)}


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = logical_state(a), logical_state(b)
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_reload_into_weight_moved_to_an_offset() -> None:
    model = cold_start(A, move_proj_next_to_other)
    before = addresses(model)
    report = direct_reload(model, B)
    reference = cold_start(B, move_proj_next_to_other)
    assert_same_state(model, reference)
    assert torch.equal(model(IDS), reference(IDS))
    assert addresses(model) == before
    moved = {r.name for r in report.relocations}
    assert {"proj.weight", "other.weight"} <= moved
    # back to A: equals a cold start of A, neighbour intact
    direct_reload(model, A)
    assert_same_state(model, cold_start(A, move_proj_next_to_other))


def offset_only_resolver(entry, live):  # the bug of vLLM PR 65281, reproduced on purpose
    view = torch.as_strided(live.detach(), entry.shape, entry.stride, entry.storage_offset)
    return resolve_mod.ResolvedTarget(entry.name, view)


def test_offset_only_resolution_is_caught_by_the_proof(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug of vLLM PR 65281 reproduced in the resolver itself (and the overlap guard off):
    the view at the recorded offset of the new storage holds the neighbour's values, so the
    proof at load calls the weight transformed and nothing is written."""
    monkeypatch.setattr(plan_mod, "resolve_target", offset_only_resolver)
    monkeypatch.setattr(proof_mod, "resolve_target", offset_only_resolver)
    monkeypatch.setattr(plan_mod, "overlapping_targets", lambda targets, aliases: {})
    model = cold_start(A, move_proj_next_to_other)
    before = snapshot_bytes(model)
    with pytest.raises(DirectReloadError, match="transformed") as info:
        direct_reload(model, B)
    assert "proj.weight" in info.value.names
    assert snapshot_bytes(model) == before


def test_overlap_guard_refuses_offset_only_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    """An offset-only resolver at push time only: refused as not the view proven at load; the
    overlap guard, the second line of defence, finds the same targets overlapping."""
    monkeypatch.setattr(plan_mod, "resolve_target", offset_only_resolver)
    model = cold_start(A, move_proj_next_to_other)
    before = snapshot_bytes(model)
    with pytest.raises(DirectReloadError, match="not the view proven") as info:
        direct_reload(model, B)
    assert info.value.names == ["proj.weight"]
    assert snapshot_bytes(model) == before
    layout = bridge_state(model).layout
    assert layout is not None
    live = {n: t for n, t, _ in live_tensors(model)}
    targets = {n: offset_only_resolver(e, live[n]) for n, e in layout.tensors.items()}
    assert "overlaps" in plan_mod.overlapping_targets(targets, layout.aliases())["proj.weight"]


def transpose_in_place(model: Toy) -> None:
    model.proj.weight.data = model.proj.weight.data.t()


def narrow_in_place(model: Toy) -> None:
    model.other.weight.data = model.other.weight.data[:, :4]


def restride(model: Toy) -> None:
    w = model.proj.weight
    column_major = w.detach().t().contiguous()
    set_storage(w, column_major, 0, w.shape, (1, w.shape[0]))


def pad_rows(model: Toy) -> None:
    w = model.other.weight
    padded = torch.zeros(8, 8 + 5)
    padded[:, :8].copy_(w.detach())
    set_storage(w, padded, 0, w.shape, (13, 1))


@pytest.mark.parametrize(
    "process", [transpose_in_place, narrow_in_place, restride, pad_rows, lambda m: None]
)
def test_view_transforms_and_moves_match_cold_start(process: Callable[[Toy], None]) -> None:
    model = cold_start(A, process)
    before = addresses(model)
    direct_reload(model, B)
    assert_same_state(model, cold_start(B, process))
    assert addresses(model) == before


def test_tied_weight_written_once_or_twice() -> None:
    model = cold_start(A, lambda m: None)
    ckpt = dict(B)
    direct_reload(model, ckpt)  # only emb.weight: head.weight is its tied twin
    assert torch.equal(model.head.weight, B["emb.weight"])
    ckpt["head.weight"] = B["emb.weight"]
    direct_reload(model, ckpt)
    assert_same_state(model, cold_start(B, lambda m: None))


def test_dtype_conversion_fp32_checkpoint_into_bf16_model() -> None:
    model = Toy().to(torch.bfloat16)
    load_by_name(model, A)
    record_checkpoint_layout(model)
    direct_reload(model, B)
    ref = Toy().to(torch.bfloat16)
    load_by_name(ref, B)
    assert_same_state(model, ref)


class Fused(nn.Module):
    """A vLLM-style layer: q, k and v checkpoint tensors stacked into one qkv parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Parameter(torch.zeros(12, 4))
        self.out = nn.Parameter(torch.zeros(4, 4))

    def load_weights(self, weights) -> set[str]:
        offsets = {"q": 0, "k": 4, "v": 8}
        loaded = set()
        for name, t in weights:
            if name == "out":
                self.out.data.copy_(t)
            else:
                self.qkv.data.narrow(0, offsets[name], 4).copy_(t)
            loaded.add(name)
        return loaded


def fused_ckpt(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(4, 4, generator=g) for n in ("q", "k", "v", "out")}


def fused_cold(ckpt, process) -> Fused:
    m = Fused()
    with torch.no_grad():
        m.load_weights(ckpt.items())
    record_checkpoint_layout(m, checkpoint={n: TensorSpec((4, 4), torch.float32) for n in ckpt})
    process(m)
    return m


def test_fused_loader_writes_through_resolved_views() -> None:
    def move_qkv(m: Fused) -> None:
        buf = torch.zeros(100)
        buf[20:68].copy_(m.qkv.detach().reshape(-1))
        set_storage(m.qkv, buf, 20, (12, 4), (4, 1))

    model = fused_cold(fused_ckpt(0), move_qkv)
    before = addresses(model)
    direct_reload(model, fused_ckpt(1))
    assert_same_state(model, fused_cold(fused_ckpt(1), move_qkv))
    assert addresses(model) == before


def emptied(model: Toy) -> None:
    model.proj.weight.data = torch.empty(0)


def moved_and_reshaped(model: Toy) -> None:
    w = model.other.weight
    padded = torch.zeros(10, 8)
    padded[:8].copy_(w.detach())
    set_storage(w, padded, 0, (10, 8), (8, 1))


def packed_dtype(model: Toy) -> None:
    model.proj.weight.data = model.proj.weight.data.to(torch.float16)


@pytest.mark.parametrize(
    ("process", "name", "why"),
    [
        (emptied, "proj.weight", "emptied"),
        (moved_and_reshaped, "other.weight", "reshaped"),
        (packed_dtype, "proj.weight", "dtype changed"),
    ],
)
def test_not_directly_reloadable_is_refused_before_writing(process, name, why) -> None:
    model = cold_start(A, process)
    before = snapshot_bytes(model)
    with pytest.raises(DirectReloadError, match=why) as info:
        direct_reload(model, B)
    assert name in info.value.names
    assert snapshot_bytes(model) == before


def _missing(c):
    c.pop("other.bias")


def _extra(c):
    c["ghost.weight"] = torch.zeros(2)


def _shape(c):
    c["proj.weight"] = torch.zeros(8, 9)


def _dtype(c):
    c["proj.weight"] = torch.zeros(8, 8, dtype=torch.int32)


def _nan(c):
    c["other.bias"] = c["other.bias"].clone().index_fill_(0, torch.tensor([3]), float("nan"))


@pytest.mark.parametrize(
    ("mutate", "name", "why"),
    [
        (_missing, "other.bias", "missing"),
        (_extra, "ghost.weight", "unexpected"),
        (_shape, "proj.weight", "shape"),
        (_dtype, "proj.weight", "cannot be converted"),
        (_nan, "other.bias", "NaN"),
    ],
)
def test_bad_checkpoint_rejected_and_model_unchanged(mutate, name, why) -> None:
    model = cold_start(A, move_proj_next_to_other)
    before = snapshot_bytes(model)
    ckpt = dict(B)
    mutate(ckpt)
    with pytest.raises(DirectReloadError, match=why) as info:
        direct_reload(model, ckpt)
    assert info.value.names == [name]
    assert snapshot_bytes(model) == before


def test_nan_guard_can_be_switched_off() -> None:
    model = cold_start(A, lambda m: None)
    ckpt = dict(B)
    _nan(ckpt)
    direct_reload(model, ckpt, check_finite=False)
    assert torch.isnan(model.other.bias).any()


def test_failure_mid_reload_marks_undefined_until_a_complete_reload() -> None:
    model = cold_start(A, move_proj_next_to_other)
    before = addresses(model)

    def failing_load(weights) -> None:
        for i, (name, t) in enumerate(weights):
            if i == 2:
                raise OSError("injected: disk vanished")
            model.get_parameter(name).data.copy_(t) if "scale" not in name else None

    with pytest.raises(DirectReloadError, match="injected"):
        direct_reload(model, B, load=failing_load)
    assert "injected" in (undefined_reason(model) or "")
    assert addresses(model) == before  # views restored even on failure
    report = direct_reload(model, B)
    assert report.recovered_from_undefined and undefined_reason(model) is None
    assert_same_state(model, cold_start(B, move_proj_next_to_other))


def test_a_write_with_pre_images_restores_itself_and_can_be_undone() -> None:
    """Weights pushed from memory have no file to re-read (``pre_images=True``): a write that
    fails midway puts back every byte and leaves the model defined, naming the failure; one
    that succeeds hands over an undo log that takes it back bit for bit (the fused buffer
    included), whose size is the targets'."""
    model = cold_start(A, move_proj_next_to_other)
    before = snapshot_bytes(model)

    def failing_load(weights) -> None:
        for i, (name, t) in enumerate(weights):
            if i == 2:
                raise OSError("injected: the trainer's tensor vanished")
            model.get_parameter(name).data.copy_(t) if "scale" not in name else None

    prepared = prepare_direct_reload(model, B, pre_images=True)
    with pytest.raises(DirectReloadError, match="restored from their pre-images"):
        prepared.run(failing_load)
    assert undefined_reason(model) is None
    assert snapshot_bytes(model) == before
    assert prepared.undo_log is None  # nothing written to take back
    prepared = prepare_direct_reload(model, B, pre_images=True)
    prepared.run()
    assert_same_state(model, cold_start(B, move_proj_next_to_other))
    undo = prepared.undo_log
    assert undo is not None and undo.nbytes == sum(t.numel() * 4 for t in B.values())
    live = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for _, _, pre in undo.entries:  # the store: in host memory, none of it the model's storage
        assert pre.device.type == "cpu" and pre.untyped_storage().data_ptr() not in live
    undo.undo(model)
    assert snapshot_bytes(model) == before
    part = {"proj.weight": B["proj.weight"]}  # a partial write: the same, every target kept
    prepared = prepare_direct_reload(model, part, pre_images=True, partial=True)
    prepared.run()
    assert prepared.undo_log is not None
    prepared.undo_log.undo(model)
    assert snapshot_bytes(model) == before


def test_a_session_exposes_views_to_the_normal_loading_path() -> None:
    model = cold_start(A, move_proj_next_to_other)
    before = addresses(model)
    with direct_reload_session(model, B) as reload:
        # inside the session, parameters carry checkpoint layout; a plain loader works unchanged
        load_by_name(model, dict(reload.weights))
    report = reload.report
    assert report is not None
    assert addresses(model) == before
    assert {r.name for r in report.relocations} >= {"proj.weight"}
    assert_same_state(model, cold_start(B, move_proj_next_to_other))


def test_a_complete_session_that_skips_a_planned_target_is_refused_by_name() -> None:
    """A session declared complete checks that the load wrote every planned target."""
    model = cold_start(A, move_proj_next_to_other)
    with (
        pytest.raises(DirectReloadError, match="did not write every weight") as info,
        direct_reload_session(model, B) as reload,
    ):
        load_by_name(model, {n: t for n, t in reload.weights if n != "other.weight"})
    assert info.value.names == ["other.weight"]
    assert "unwritten" in (undefined_reason(model) or "")
    direct_reload(model, B)  # a complete reload makes it whole again
    assert undefined_reason(model) is None
    assert_same_state(model, cold_start(B, move_proj_next_to_other))


def test_a_session_validates_the_checkpoint_before_writing() -> None:
    model = cold_start(A, move_proj_next_to_other)
    before = snapshot_bytes(model)
    bad = {**B, "proj.weight": torch.full_like(B["proj.weight"], float("nan"))}
    with (
        pytest.raises(DirectReloadError, match="nothing was written") as info,
        direct_reload_session(model, bad) as reload,
    ):
        load_by_name(model, dict(reload.weights))
    assert info.value.names == ["proj.weight"]
    assert snapshot_bytes(model) == before


# -- property: random relocation plans ---------------------------------------------------------

OPS = ["keep", "transpose", "fuse", "restride", "pad", "empty", "reshape"]
NAMES = ["proj.weight", "other.weight", "emb.weight"]


def apply_plan(model: Toy, plan: dict[str, str], fuse_gap: int) -> None:
    live = {n: t for n, t, _ in live_tensors(model)}
    fused_names = [n for n in NAMES if plan[n] == "fuse"]
    if fused_names:
        total = sum(live[n].numel() + fuse_gap for n in fused_names)
        fused = torch.zeros(total)
        offset = fuse_gap
        for n in fused_names:
            w = live[n]
            fused[offset : offset + w.numel()].copy_(w.detach().reshape(-1))
            set_storage(w, fused, offset, w.shape, w.stride())
            offset += w.numel() + fuse_gap
    for n in NAMES:
        w, op = live[n], plan[n]
        if op == "transpose":
            w.data = w.data.t()
        elif op == "restride":
            cm = w.detach().t().contiguous()
            set_storage(w, cm, 0, w.shape, (1, w.shape[0]))
        elif op == "pad":
            rows, cols = w.shape
            padded = torch.zeros(rows, cols + 3)
            padded[:, :cols].copy_(w.detach())
            set_storage(w, padded, 0, w.shape, (cols + 3, 1))
        elif op == "empty":
            w.data = torch.empty(0)
        elif op == "reshape":
            flat = w.detach().reshape(-1).clone()
            set_storage(w, flat, 0, (flat.numel(),), (1,))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    plan=st.fixed_dictionaries({n: st.sampled_from(OPS) for n in NAMES}),
    fuse_gap=st.integers(0, 7),
    seed=st.integers(0, 1000),
)
def test_random_relocation_plans_equal_cold_start_or_refuse(plan, fuse_gap, seed) -> None:
    new = toy_checkpoint(seed + 2)

    def process(m: Toy) -> None:
        apply_plan(m, plan, fuse_gap)

    model = cold_start(A, process)
    before, raw = addresses(model), snapshot_bytes(model)
    if {"empty", "reshape"} & set(plan.values()):
        with pytest.raises(DirectReloadError):
            direct_reload(model, new)
        assert snapshot_bytes(model) == raw
    else:
        direct_reload(model, new)
        assert_same_state(model, cold_start(new, process))
    assert addresses(model) == before
