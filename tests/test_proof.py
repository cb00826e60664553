"""Proof that a direct write reaches what the model computes with, on toy modules through the
public API: transformed values and derived state are refused by name with nothing written, a
refresher makes derived state writable, and the read-back catches a clobbered write."""

from __future__ import annotations

import pytest
import torch
from helpers import IDS, A, B, Toy, cold_start, load_by_name, snapshot_bytes

from weight_bridge.direct import (
    DirectReloadError,
    Refresher,
    direct_reload,
    direct_reload_session,
    prove_checkpoint_layout,
    record_checkpoint_layout,
)
from weight_bridge.direct import readback as readback_module
from weight_bridge.direct.state import undefined_reason
from weight_bridge.layout import fingerprint


class Processed(Toy):
    """Toy whose forward reads what post-load processing left: a transposed copy of ``proj``
    (``proj_t``) when present, and ``other`` scaled by ``other_scale``."""

    other_scale = 1.0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) * self.scale
        proj_t = getattr(self.proj, "weight_t", None)
        proj_t = self.proj.weight.t() if proj_t is None else proj_t
        other = torch.nn.functional.linear(h @ proj_t, self.other.weight / self.other_scale)
        return self.head(torch.tanh(other + self.other.bias))


def transpose_into_new_storage(model: Processed) -> None:
    """Square weight re-stored transposed, same shape and dtype: a transform, not a move."""
    w = model.proj.weight
    w.data = w.data.t().contiguous()
    model.proj.weight_t = model.proj.weight  # forward reads the (already transposed) weight


def fold_scale_in_place(model: Processed) -> None:
    model.other.weight.data.mul_(2.0)
    model.other_scale = 2.0


def derive_transposed_copy(model: Processed) -> None:
    model.proj.weight_t = model.proj.weight.detach().t().contiguous()


def cold(ckpt, process) -> Processed:
    model = Processed()
    load_by_name(model, ckpt)
    record_checkpoint_layout(model)
    process(model)
    return model


def test_fingerprint_tells_a_transpose_and_a_rescale_from_the_same_values() -> None:
    w = torch.randn(64, 64)
    fp = fingerprint(w)
    assert fp.matches(fingerprint(w.clone()))
    assert fp.matches(fingerprint(w.t().contiguous().t()))  # same logical values, other strides
    assert not fp.matches(fingerprint(w.t()))
    assert not fp.matches(fingerprint(w * 1.001))
    assert not fp.matches(fingerprint(-w))
    big = torch.randn(3, 70_000)  # more than one chunk: chunks that swap places differ too
    assert not fingerprint(big).matches(fingerprint(big.flip(0)))


@pytest.mark.parametrize(
    ("process", "name", "why"),
    [
        (transpose_into_new_storage, "proj.weight", "transformed"),
        (fold_scale_in_place, "other.weight", "transformed"),
        (derive_transposed_copy, "proj.weight", "weight_t"),
    ],
)
def test_unprovable_writes_are_refused_by_name_before_writing(process, name, why) -> None:
    model = cold(A, process)
    want = model(IDS)
    before = snapshot_bytes(model)
    with pytest.raises(DirectReloadError, match=why) as info:
        direct_reload(model, B)
    assert name in info.value.names
    assert snapshot_bytes(model) == before
    assert torch.equal(model(IDS), want)
    assert undefined_reason(model) is None


def test_without_the_proof_the_same_push_would_be_silently_wrong() -> None:
    """Power of the test above: the values a plain write leaves differ from a cold start."""
    for process in (transpose_into_new_storage, fold_scale_in_place, derive_transposed_copy):
        model = cold(A, process)
        with torch.no_grad():
            load_by_name(model, B)  # what "moved, same shape -> current offset" writes
        assert not torch.allclose(model(IDS), cold(B, process)(IDS)), process.__name__


class TransposedCopy:
    """A :class:`~weight_bridge.direct.Refresher` (structural: no base class needed)."""

    kind = "transposed copy"
    explains = frozenset({"weight_t"})

    def __init__(self) -> None:
        self.sources: dict[str, torch.Tensor] = {}

    def refresh(self, module: torch.nn.Module) -> None:
        module.weight_t.copy_(module.weight.detach().t())


def test_a_refresher_makes_derived_state_writable_and_equal_to_a_cold_start() -> None:
    model = cold(A, derive_transposed_copy)
    refresher: Refresher = TransposedCopy()
    prove_checkpoint_layout(model, {"proj": refresher})
    address = model.proj.weight_t.data_ptr()
    report = direct_reload(model, B)
    assert report.refreshed == {"proj": "transposed copy"}
    assert torch.equal(model(IDS), cold(B, derive_transposed_copy)(IDS))
    assert model.proj.weight_t.data_ptr() == address


def test_read_back_catches_a_write_that_a_later_one_overwrote() -> None:
    model = cold_start(A, lambda m: None)

    def clobbering_load(weights) -> None:
        for name, t in weights:
            model.get_parameter(name).data.copy_(t) if name != "scale" else model.scale.copy_(t)
        model.proj.weight.data.fill_(0.0)  # e.g. a neighbour's write landing on it

    with pytest.raises(DirectReloadError, match="read-back") as info:
        direct_reload(model, B, load=clobbering_load)
    assert info.value.names == ["proj.weight"]
    assert "read-back" in (undefined_reason(model) or "")


class Wide(torch.nn.Module):
    """One tensor of more rows than the sampled read-back keeps (8 of 1000: 0, 143, 285, 428,
    571, 714, 856, 999), stored in bf16 so that every write casts, then a small one."""

    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Parameter(torch.zeros(1000, 16, dtype=torch.bfloat16))
        self.small = torch.nn.Parameter(torch.zeros(4))


def wide(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(1000, 16, generator=g)
    big[::7, 3] = -0.0  # signed zeros: bits, not just values, are compared
    return {"big": big, "small": torch.randn(4, generator=g)}


def clobbering_row(model: Wide, row: int | None):
    """A loader that copies by name and, while writing ``small`` (``big`` was sealed when it
    asked for ``small``), overwrites one element of ``big``'s ``row`` with 123.0."""

    def load(weights) -> None:
        for name, t in weights:
            model.get_parameter(name).data.copy_(t)
            if name == "small" and row is not None:
                model.big.data[row, 5].fill_(123.0)

    return load


@pytest.mark.parametrize("readback", ["full", "full-device-digest", "sampled"])
@pytest.mark.parametrize("row", [3, 998, 999, None])
def test_read_back_of_a_sealed_tensor_that_a_later_write_clobbered(
    readback, row, monkeypatch
) -> None:
    """``"full"`` catches a later write anywhere in an earlier tensor (it compares every element
    bit for bit after the last write: a digest of each source taken when it was sealed against
    the same digest of the engine's bytes), and accepts the exact push; with the digest an
    accelerator uses (``exact_fingerprint``) too. ``"sampled"`` catches it only in the rows it
    keeps: row 999 (the last) is refused; rows 3 and 998 are not kept, so that push is accepted
    with 123.0 in the engine (what ``"sampled"`` trades for its cost)."""
    if readback == "full-device-digest":
        monkeypatch.setattr(readback_module, "_DIGESTS", {})
        readback = "full"
    model = Wide()
    load_by_name(model, wide(0))
    record_checkpoint_layout(model)
    caught = row is not None and (readback == "full" or row == 999)
    if not caught:
        report = direct_reload(model, wide(1), load=clobbering_row(model, row), readback=readback)
        assert report.verified_writes == 2 and undefined_reason(model) is None
        want = wide(1)["big"].to(torch.bfloat16)
        if row is not None:
            want[row, 5] = 123.0  # the miss, spelled out
        assert torch.equal(model.big.data.view(torch.int16), want.view(torch.int16))
        return
    with pytest.raises(DirectReloadError, match="read-back") as info:
        direct_reload(model, wide(1), load=clobbering_row(model, row), readback=readback)
    assert info.value.names == ["big"]
    assert "read-back" in (undefined_reason(model) or "")


def test_interrupt_inside_a_session_propagates_and_leaves_the_model_undefined() -> None:
    model = cold_start(A, lambda m: None)
    with pytest.raises(KeyboardInterrupt), direct_reload_session(model, B):
        load_by_name(model, {"proj.weight": B["proj.weight"]})
        raise KeyboardInterrupt
    assert "KeyboardInterrupt" in (undefined_reason(model) or "")
    with pytest.raises(KeyboardInterrupt):
        direct_reload(model, B, load=lambda w: (_ for _ in ()).throw(KeyboardInterrupt()))
    report = direct_reload(model, B)
    assert report.recovered_from_undefined and undefined_reason(model) is None
