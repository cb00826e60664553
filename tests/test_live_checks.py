"""What a push from memory checks of its tensors, in process and without vLLM
(``weight_bridge.checkpoint.live``, ``weight_bridge.direct.validate``).

* A live tensor produces what it declares: one whose produced shape or device differs is
  refused by name in the stream, mid-write, and the model is restored bit for bit (a row
  produced for a declared matrix was broadcast into every row and accepted by the read-back).
* Each rank checks what it writes: once a complete write showed which elements of each tensor
  this rank's loader takes (a tensor-parallel shard), NaN/Inf and the range are read there
  only, before anything is written; a NaN in a part another rank writes is that rank's to
  refuse (the update agrees on every rank's answer). What the write map cannot say (no write
  yet, a merge, a non-contiguous source) is read whole.
"""

from __future__ import annotations

import pytest
import torch
from helpers import A, cold_start, snapshot_bytes

from weight_bridge.checkpoint.live import LiveCheckpoint, LiveTensor
from weight_bridge.direct import (
    DirectReloadError,
    direct_reload,
    prepare_direct_reload,
    record_checkpoint_layout,
)
from weight_bridge.direct.state import bridge_state, undefined_reason
from weight_bridge.direct.undo import HostStore
from weight_bridge.layout import TensorSpec


def _push(model, tensors, store=None):
    """A push from memory as the worker makes it: described, then streamed."""
    live = LiveCheckpoint.of(tensors)
    prepared = prepare_direct_reload(
        model, list(live.tensors()), pre_images=store or False, stream=live.stream
    )
    return prepared.run()


@pytest.mark.parametrize(
    ("produce", "said"),
    [
        (lambda s: s[0][:1], "produced shape [1, 8] (declared [8, 8])"),
        (lambda s: s[0].to("meta"), "produced a tensor on meta (its parts are on cpu)"),
    ],
    ids=["a-row-for-a-matrix", "on-another-device"],
)
def test_a_tensor_that_produces_other_than_it_declares_is_refused_and_rolled_back(
    produce, said: str
) -> None:
    model = cold_start(A, lambda m: None)
    before = snapshot_bytes(model)
    changed = {n: t + 1 for n, t in A.items()}
    items = [LiveTensor.of(n, t) for n, t in changed.items()]
    wrong = [i for i, t in enumerate(items) if t.name == "other.weight"][0]
    assert wrong > 0  # mid-write: the tensors before it were written
    source = changed["other.weight"]
    items[wrong] = LiveTensor("other.weight", (8, 8), source.dtype, [source], produce)
    with pytest.raises(DirectReloadError, match="restored from their pre-images") as err:
        _push(model, items, HostStore())
    assert "other.weight" in str(err.value) and said in str(err.value), err.value
    assert undefined_reason(model) is None and snapshot_bytes(model) == before


class Shard(torch.nn.Module):
    """The second of two tensor-parallel ranks, loaded as vLLM's loaders load it: of the
    checkpoint's ``rows`` (8, 8) it holds and writes rows 4..8, of ``cols`` (8, 8) columns
    4..8, and ``norm`` (8,) whole."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = torch.nn.Parameter(torch.zeros(4, 8), requires_grad=False)
        self.cols = torch.nn.Parameter(torch.zeros(8, 4), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(8), requires_grad=False)

    def load_weights(self, weights) -> None:
        for name, t in weights:
            if name == "rows":
                self.rows.data.copy_(t.narrow(0, 4, 4))
            elif name == "cols":
                self.cols.data.copy_(t.narrow(1, 4, 4))
            else:
                self.norm.data.copy_(t)


def _checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "rows": torch.randn(8, 8, generator=g),
        "cols": torch.randn(8, 8, generator=g),
        "norm": torch.randn(8, generator=g),
    }


def _shard(written: bool = True) -> Shard:
    """A rank loaded and recorded; ``written``: a complete push showed what it writes."""
    first = _checkpoint(0)
    model = Shard()
    model.load_weights(first.items())
    spec = {n: TensorSpec(tuple(t.shape), t.dtype) for n, t in first.items()}
    record_checkpoint_layout(model, checkpoint=spec)
    if written:
        direct_reload(model, first)
        assert bridge_state(model).write_map is not None
    return model


def _with(
    value: float, where: dict[str, tuple[int, int]], dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    out = {n: t.to(dtype) for n, t in _checkpoint(1).items()}
    for name, (i, j) in where.items():
        out[name][i, j] = value
    return out


ELSEWHERE = {"rows": (1, 2), "cols": (6, 3)}  # what the other rank writes
HERE = {"rows": (5, 2), "cols": (6, 5)}  # what this rank writes


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_each_rank_checks_what_it_writes(value: float) -> None:
    model = _shard()
    sent = _with(value, ELSEWHERE)
    _push(model, sent)  # not this rank's elements: the other rank's check reads them
    assert torch.equal(model.rows, sent["rows"][4:])
    assert torch.equal(model.cols, sent["cols"][:, 4:])
    before = snapshot_bytes(model)
    for name, at in HERE.items():
        with pytest.raises(DirectReloadError, match="nothing was written") as err:
            _push(model, _with(value, {name: at}))
        assert set(err.value.problems) == {name}, err.value
        assert "NaN" in err.value.problems[name] or "Inf" in err.value.problems[name]
    assert snapshot_bytes(model) == before


def test_the_range_check_reads_what_the_rank_writes_too() -> None:
    """float64 from the trainer into the engine's float32: a value beyond float32's range is
    refused where this rank writes it, and the other rank's to refuse elsewhere."""
    model = _shard()
    wide = _with(1e39, ELSEWHERE, torch.float64)
    _push(model, wide)
    assert torch.equal(model.rows, wide["rows"][4:].float())
    before = snapshot_bytes(model)
    wide = _with(1e39, HERE, torch.float64)
    with pytest.raises(DirectReloadError, match="nothing was written") as err:
        _push(model, wide)
    assert set(err.value.problems) == set(HERE), err.value
    assert all("beyond the range of torch.float32" in why for why in err.value.problems.values())
    assert snapshot_bytes(model) == before


def test_the_part_written_is_found_in_a_source_that_views_a_larger_buffer() -> None:
    """A trainer tensor at an offset in its storage (a view of a flat buffer): the copies the
    loader took are found at the same places of it."""
    model = _shard()
    copies = bridge_state(model).write_map.segments  # type: ignore[union-attr]
    flat = torch.arange(72, dtype=torch.float32)
    rows, cols = flat[8:].view(8, 8), flat[:64].view(8, 8)
    (got_rows,) = LiveTensor.of("rows", rows).written_parts(copies["rows"]) or []
    (got_cols,) = LiveTensor.of("cols", cols).written_parts(copies["cols"]) or []
    assert torch.equal(got_rows, rows[4:]) and torch.equal(got_cols, cols[:, 4:])
    assert LiveTensor.of("rows", rows.t()).written_parts(copies["rows"]) is None


@pytest.mark.parametrize(
    "how",
    ["no-write-yet", "merged", "not-contiguous"],
)
def test_what_the_write_map_cannot_narrow_is_read_whole(how: str) -> None:
    model = _shard(written=how != "no-write-yet")
    sent = _with(float("nan"), {"rows": ELSEWHERE["rows"]})
    items = [LiveTensor.of(n, t) for n, t in sent.items()]
    if how == "merged":  # a LoRA merge: the produced tensor is not the source
        rows = sent["rows"]
        items[0] = LiveTensor("rows", (8, 8), rows.dtype, [rows], lambda s: s[0] * 1.0)
    elif how == "not-contiguous":
        items[0] = LiveTensor.of("rows", sent["rows"].t().contiguous().t())
    before = snapshot_bytes(model)
    with pytest.raises(DirectReloadError, match="nothing was written") as err:
        _push(model, items)
    assert set(err.value.problems) == {"rows"} and "NaN" in err.value.problems["rows"]
    assert snapshot_bytes(model) == before


def test_a_client_of_an_engine_in_another_process_refuses_tensors_in_memory_unstarted() -> None:
    """Tensors in memory cross to the worker as the object itself: a client whose engine runs
    in another process (HTTP here) refuses them by name before it starts or pauses anything."""
    from weight_bridge.checkpoint import CheckpointError
    from weight_bridge.vllm.clients.bridge_client import run_blocking
    from weight_bridge.vllm.clients.http import HTTPClient

    client = HTTPClient("http://127.0.0.1:9")  # nothing listens: a call would fail otherwise
    live = LiveCheckpoint.of(A, {"version": "3"})
    for push in (client.push, lambda c: run_blocking(client.push_async(c))):
        with pytest.raises(CheckpointError, match="tensors in memory, version 3: HTTPClient's"):
            push(live)
