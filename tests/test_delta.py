"""Delta checkpoints in the direct-reload core: real files, real tensors, no engine.

The reference is always the full new tensors: after a delta the model holds them bit for bit
(through a fused, moved qkv storage), and after an undo it holds the old ones bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import delta_checkpoint, set_storage

import weight_bridge.direct.delta_writes as writes_mod
from weight_bridge.checkpoint import CheckpointError, CheckpointReader
from weight_bridge.delta.format import FINGERPRINTS_KEY, part_name, read_delta
from weight_bridge.direct import DirectReloadError, direct_reload, record_checkpoint_layout
from weight_bridge.direct.delta import prepare_delta
from weight_bridge.direct.state import bridge_state
from weight_bridge.exact import bits_of, exact_fingerprint, fingerprint_change
from weight_bridge.layout import TensorSpec
from weight_bridge.testing.deltas import COLS, ROWS, applied_memory, wide_pair

NAMES = ("q", "k", "v", "out")


def ckpt(seed: int, dtype=torch.bfloat16, n: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(n, 4, generator=g).to(dtype) for name in NAMES}


class Big(torch.nn.Module):
    """A vLLM-style layer in bf16: q, k and v loaded into one fused qkv parameter (which
    processing then moves into a larger buffer at an offset), and ``out``."""

    def __init__(self, n: int = 64) -> None:
        super().__init__()
        self.n = n
        self.qkv = torch.nn.Parameter(torch.zeros(3 * n, 4, dtype=torch.bfloat16))
        self.out = torch.nn.Parameter(torch.zeros(n, 4, dtype=torch.bfloat16))

    transform_out = False  # a loader that copies a new tensor made from ``out``

    def load_weights(self, weights) -> set[str]:
        offsets = {"q": 0, "k": self.n, "v": 2 * self.n}
        for name, t in weights:
            if name == "out":
                self.out.data.copy_(t.clone() if self.transform_out else t)
            else:
                self.qkv.data.narrow(0, offsets[name], self.n).copy_(t)
        return set(NAMES)


def engine_model(first: dict[str, torch.Tensor], transform_out: bool = False) -> Big:
    """Loaded like an engine: load, record, move qkv (processing), then a complete push."""
    m = Big()
    m.transform_out = transform_out
    with torch.no_grad():
        m.load_weights(first.items())
    spec = {n: TensorSpec(tuple(t.shape), t.dtype) for n, t in first.items()}
    record_checkpoint_layout(m, checkpoint=spec)
    buf = torch.zeros(4 * 64 * 4, dtype=torch.bfloat16)
    buf[20 : 20 + m.qkv.numel()].copy_(m.qkv.detach().reshape(-1))
    set_storage(m.qkv, buf, 20, m.qkv.shape, m.qkv.stride())
    direct_reload(m, first)  # the complete write the write map is learned from
    return m


def held(m: Big) -> dict[str, torch.Tensor]:
    n = m.n
    q = m.qkv.detach()
    return {"q": q[:n], "k": q[n : 2 * n], "v": q[2 * n :], "out": m.out.detach()}


def assert_bits(m: Big, want: dict[str, torch.Tensor]) -> None:
    for name, t in held(m).items():
        assert torch.equal(t.view(torch.int16), want[name].view(torch.int16)), name


def nudge(base: dict[str, torch.Tensor], frac: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in base.items():
        mask = torch.rand(t.shape, generator=g) < frac
        out[name] = torch.where(mask, (t.float() * 1.01 + 0.003).to(t.dtype), t)
    return out


def write_delta(path: Path, old: dict, new: dict, base: str = "A", version: str = "B") -> Path:
    return delta_checkpoint(old, new, base, version, path)


def decoded(path: Path):
    reader = CheckpointReader(path)
    return reader, read_delta(str(path), reader.metadata, dict(reader.tensors()))


def test_a_delta_writes_the_new_bits_through_a_moved_fused_storage(tmp_path) -> None:
    a = ckpt(0)
    b = nudge(a, 0.05, 1)
    m = engine_model(a)
    bridge_state(m).fingerprints = {n: exact_fingerprint(t) for n, t in a.items()}
    before = (m.qkv.data_ptr(), m.out.data_ptr())
    reader, delta = decoded(write_delta(tmp_path / "d.safetensors", a, b))
    assert delta.sparse and not delta.dense  # 5 % changed: every tensor sparse
    prepared = prepare_delta(m, delta, readback="full")
    report = prepared.run()
    assert_bits(m, b)
    assert (m.qkv.data_ptr(), m.out.data_ptr()) == before
    assert report.changed == delta.changed
    assert prepared.undo_log is not None
    # its positions as the file keeps its indices (2 bytes each), and the pre-images
    carried = sum(t.nbytes for _, t in reader.tensors())
    assert prepared.undo_log.nbytes <= 1.25 * carried, (prepared.undo_log.nbytes, carried)
    prepared.undo_log.undo(m)
    assert_bits(m, a)
    reader.close()


def test_a_dense_tensor_in_a_delta_and_a_chain_of_deltas(tmp_path) -> None:
    a = ckpt(0)
    m = engine_model(a)
    bridge_state(m).fingerprints = {n: exact_fingerprint(t) for n, t in a.items()}
    cur = a
    for step in range(1, 6):
        new = nudge(cur, 0.8 if step == 3 else 0.02, step)  # step 3: dense tensors
        reader, delta = decoded(write_delta(tmp_path / f"{step}.safetensors", cur, new))
        assert bool(delta.dense) == (step == 3)
        prepare_delta(m, delta).run()
        reader.close()
        assert_bits(m, new)
        cur = new


def test_a_fault_in_a_dense_tensors_copy_restores_the_previous_bits(tmp_path, monkeypatch):
    """FAULT INJECTION: the second segment copy of a delta's dense tensors raises (q and k
    dense, written view to view into the moved fused storage); the undo log restores the
    first."""
    a = ckpt(0)
    m = engine_model(a)
    b = nudge(a, 0.05, 1)
    path = delta_checkpoint(a, b, "A", "B", tmp_path / "d.safetensors", dense={"q", "k"})
    reader, delta = decoded(path)
    assert {n for n, _ in delta.dense} == {"q", "k"}
    calls = []
    original = writes_mod.copy

    def faulty(live, values):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected fault in the second dense copy")
        original(live, values)

    monkeypatch.setattr(writes_mod, "copy", faulty)
    with pytest.raises(DirectReloadError, match="injected.*undo log restored"):
        prepare_delta(m, delta).run()
    assert len(calls) == 2 and bridge_state(m).undefined is None
    assert_bits(m, a)
    reader.close()


def test_dense_values_that_are_not_the_trainers_tensor_are_refused_and_undone(tmp_path):
    """A dense tensor is checked against the fingerprint the trainer recorded for it (not
    against the base, which a full overwrite does not need): values that are not the trainer's
    tensor (here, the recorded fingerprint of another) are refused by name after the read-back,
    and the undo log restores the previous bits."""
    a = ckpt(0)
    m = engine_model(a)
    bridge_state(m).fingerprints = {n: exact_fingerprint(t) for n, t in a.items()}
    b = nudge(a, 0.05, 1)
    path = delta_checkpoint(a, b, "A", "B", tmp_path / "d.safetensors", dense={"q"})
    reader, delta = decoded(path)
    delta.fingerprints["q"] = exact_fingerprint(a["q"])  # the trainer's tensor was another
    with pytest.raises(DirectReloadError, match="undo log restored") as info:
        prepare_delta(m, delta).run()
    assert set(info.value.problems) == {"q"} and "delta's values" in info.value.problems["q"]
    assert_bits(m, a)
    reader.close()


def test_a_dense_tensor_in_a_delta_costs_its_pre_images_and_bounded_temporaries(tmp_path):
    """A delta carrying a 64 MiB bf16 tensor dense (every element changed): preparing and
    applying it peaks at no more than twice the tensor plus its undo log (this process's
    resident high-water mark, reset first: ``weight_bridge.testing.deltas``, which the GPU check
    runs on CUDA), and the log is the tensor's pre-images alone, no positions (at most 1.25x
    what the delta carried). Before: an int64 position per element, a shifted copy and int64
    fingerprint temporaries peaked near 21x."""
    size = ROWS * COLS * 2
    a, b = wide_pair(1.0)
    reader, delta = decoded(write_delta(tmp_path / "d.safetensors", a, b))
    assert [n for n, _ in delta.dense] == ["w"] and not delta.sparse
    assert exact_fingerprint(delta.dense[0][1]) == exact_fingerprint(b["w"])
    del b["w"]
    cost = applied_memory(a, delta)
    assert cost.undo <= 1.25 * size, (cost.undo, size)
    assert cost.peak <= cost.bound, f"peak {cost.peak / 2**20:.0f} MiB for a 64 MiB tensor"
    assert torch.equal(cost.model.w.detach().view(torch.int16), delta.dense[0][1].view(torch.int16))
    reader.close()


@pytest.mark.parametrize("held", [COLS, COLS // 2], ids=["whole", "column-shard"])
def test_a_sparse_tensor_in_a_delta_costs_its_undo_log_and_bounded_temporaries(tmp_path, held):
    """A delta carrying a 64 MiB bf16 tensor sparse with 45 % of its elements changed (just
    under where a dense one is smaller), into an engine that holds it whole or holds half its
    columns (a tensor-parallel shard, solved coordinate by coordinate): preparing and applying
    it peaks at no more than twice the tensor plus its undo log, and the log (positions shared
    with the scatter, in the file's 2-byte encoding, and pre-images) is at most 1.25x what the
    delta carried. Before: int64 positions, their re-encoding and int64 fingerprint
    temporaries peaked at 639 MiB (whole) and 598 MiB (shard)."""
    a, b = wide_pair(0.45)
    reader, delta = decoded(write_delta(tmp_path / "d.safetensors", a, b))
    sparse = delta.sparse["w"]
    assert not delta.dense and sparse.values.numel() > 0.4 * ROWS * COLS
    carried = sparse.values.nbytes + 2 * sparse.values.numel() + 4 * -(-ROWS * COLS // 65536)
    cost = applied_memory(a, delta, held=held)
    assert cost.undo <= 1.25 * carried, (cost.undo, carried)
    assert cost.peak <= cost.bound, f"peak {cost.peak / 2**20:.0f} MiB for a 64 MiB tensor"
    want = b["w"][:, :held]
    assert torch.equal(cost.model.w.detach().view(torch.int16), want.view(torch.int16))
    reader.close()


def test_a_fault_mid_apply_restores_the_previous_bits(tmp_path, monkeypatch) -> None:
    """FAULT INJECTION: the second scattered write raises (nothing outside can cause it)."""
    a = ckpt(0)
    m = engine_model(a)
    reader, delta = decoded(write_delta(tmp_path / "d.safetensors", a, nudge(a, 0.1, 1)))
    calls = []
    original = writes_mod.scatter

    def faulty(storage, where, values):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected fault in the second scatter")
        original(storage, where, values)

    monkeypatch.setattr(writes_mod, "scatter", faulty)
    with pytest.raises(DirectReloadError, match="injected.*undo log restored"):
        prepare_delta(m, delta).run()
    assert_bits(m, a)
    assert bridge_state(m).undefined is None
    reader.close()


def test_a_delta_on_other_bits_fails_its_fingerprint_and_is_undone(tmp_path) -> None:
    a = ckpt(0)
    m = engine_model(a)
    bridge_state(m).fingerprints = {n: exact_fingerprint(t) for n, t in a.items()}
    b = nudge(a, 0.05, 1)
    reader, delta = decoded(write_delta(tmp_path / "d.safetensors", a, b))
    idx = int(delta.sparse["q"].indices[0])
    with torch.no_grad():
        m.qkv.view(-1)[idx] += 1  # the engine drifted at an element the delta changes
    drifted = {n: t.clone() for n, t in held(m).items()}
    with pytest.raises(DirectReloadError, match="fingerprint") as info:
        prepare_delta(m, delta).run()
    assert "q" in info.value.problems and "undo log" in str(info.value)
    assert_bits(m, drifted)
    reader.close()


def test_refusals_change_nothing(tmp_path) -> None:
    a = ckpt(0)
    m = engine_model(a)
    b = nudge(a, 0.05, 1)
    path = write_delta(tmp_path / "d.safetensors", a, b)
    reader = CheckpointReader(path)
    tensors = dict(reader.tensors())
    meta = reader.metadata
    # values in another dtype than the engine holds
    wrong = dict(tensors, **{part_name("q", "values"): tensors[part_name("q", "values")].float()})
    delta = read_delta(str(path), meta, wrong)
    with pytest.raises(DirectReloadError, match="nothing was written") as info:
        prepare_delta(m, delta)
    assert "bfloat16" in info.value.problems["q"]
    # a name the model never loaded
    extra = dict(tensors, ghost=torch.zeros(2, dtype=torch.bfloat16))
    prints = json.loads(meta[FINGERPRINTS_KEY])
    meta2 = dict(meta, **{FINGERPRINTS_KEY: json.dumps({**prints, "ghost": "0" * 16})})
    with pytest.raises(DirectReloadError) as info:
        prepare_delta(m, read_delta(str(path), meta2, extra))
    assert "ghost" in info.value.problems
    assert_bits(m, a)
    reader.close()


def _corrupt(tensors: dict, name: str, part: str, value: torch.Tensor) -> dict:
    return dict(tensors, **{part_name(name, part): value})


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda t: _corrupt(t, "q", "offsets", t[part_name("q", "offsets")].flip(0)), "strictly"),
        (
            lambda t: _corrupt(t, "q", "offsets", t[part_name("q", "offsets")].clone().fill_(3)),
            "strictly",
        ),
        (lambda t: _corrupt(t, "q", "values", t[part_name("q", "values")][:-1]), "truncated"),
        (
            lambda t: {k: v for k, v in t.items() if k != part_name("q", "blocks")},
            "truncated",
        ),
        (lambda t: _corrupt(t, "q", "offsets", t[part_name("q", "offsets")] + 300), "range"),
    ],
    ids=["unsorted", "duplicate", "values-truncated", "part-missing", "out-of-range"],
)
def test_a_malformed_delta_is_refused_by_name(tmp_path, change, words) -> None:
    a = ckpt(0)
    b = nudge(a, 0.05, 1)
    path = write_delta(tmp_path / "d.safetensors", a, b)
    with CheckpointReader(path) as reader:
        tensors = {k: v.clone() for k, v in reader.tensors()}
        with pytest.raises(CheckpointError, match=words) as info:
            read_delta(str(path), reader.metadata, change(tensors))
    assert info.value.tensor == "q"


def test_a_delta_without_a_fingerprint_is_refused(tmp_path) -> None:
    a = ckpt(0)
    path = write_delta(tmp_path / "d.safetensors", a, nudge(a, 0.05, 1))
    with CheckpointReader(path) as reader:
        meta = dict(reader.metadata, **{FINGERPRINTS_KEY: "{}"})
        with pytest.raises(CheckpointError, match="fingerprint"):
            read_delta(str(path), meta, dict(reader.tensors()))


def test_a_write_that_lands_wrong_is_caught_by_the_read_back_and_undone(
    tmp_path, monkeypatch
) -> None:
    """FAULT INJECTION: a scattered write that stores other values than asked (a bad kernel);
    the fingerprint is computed from the pre-images and the delta's values, so only reading
    the written elements back can see it."""
    a = ckpt(0)
    m = engine_model(a)
    bridge_state(m).fingerprints = {n: exact_fingerprint(t) for n, t in a.items()}
    reader, delta = decoded(write_delta(tmp_path / "d.safetensors", a, nudge(a, 0.1, 1)))
    original = writes_mod.scatter

    def wrong(storage, where, values):
        original(storage, where, values)
        storage[where[:1]] = values[:1] * 2 + 1

    monkeypatch.setattr(writes_mod, "scatter", wrong)
    with pytest.raises(DirectReloadError, match="read back") as info:
        prepare_delta(m, delta).run()
    assert "undo log restored" in str(info.value)
    assert_bits(m, a)
    reader.close()


def test_explain_and_the_reader_describe_a_delta(tmp_path, capsys) -> None:
    from weight_bridge.explain import main

    a = ckpt(0)
    b = nudge(a, 0.05, 1)
    b["out"] = nudge(a, 0.9, 2)["out"]  # mostly changed: stored dense
    path = write_delta(tmp_path / "d.safetensors", a, b, base="7", version="8")
    with CheckpointReader(path) as reader:
        assert reader.is_delta
        delta = reader.delta()
        assert (delta.base, delta.version) == ("7", "8")
        assert sorted(delta.sparse) == ["k", "q", "v"] and [n for n, _ in delta.dense] == ["out"]
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "version '8' on top of base '7'" in out
    assert "4 tensors (3 sparse, 1 dense)" in out
    for name in NAMES:
        assert f"{exact_fingerprint(b[name]):016x}" in out


def test_a_tensor_its_loader_transforms_is_written_whole_or_refused(tmp_path) -> None:
    """``out``'s loader copies a new tensor made from it: the write map cannot patch it. Sent
    dense, it is written through its loader; sent sparse, it is refused by name."""
    a = ckpt(0)
    m = engine_model(a, transform_out=True)
    assert "out" in bridge_state(m).write_map.unpatchable
    b = nudge(a, 0.05, 1)
    reader, delta = decoded(write_delta(tmp_path / "sparse.safetensors", a, b))
    with pytest.raises(DirectReloadError, match="nothing was written") as info:
        prepare_delta(m, delta)
    assert "send it dense" in info.value.problems["out"]
    assert_bits(m, a)
    reader.close()
    path = delta_checkpoint(a, b, "A", "B", tmp_path / "dense.safetensors", dense={"out"})
    reader, delta = decoded(path)
    report = prepare_delta(m, delta).run()
    assert_bits(m, b)
    assert report.tensors == 4
    reader.close()


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_loader_write_that_fails_after_the_scatters_ran(tmp_path, when) -> None:
    """A delta written by two writers: the scatters, then ``out`` through its loader. FAULT
    INJECTION: the loader's writer fails *before* it writes (its ``run`` refuses: every writer
    that ran is undone from its pre-images, the model defined on the old bits) or *after* it
    wrote (the loader raises once it copied: no pre-images, so the model is undefined, never
    the new bits taken for the old)."""
    a = ckpt(0)
    m = engine_model(a, transform_out=True)
    b = nudge(a, 0.05, 1)
    path = delta_checkpoint(a, b, "A", "B", tmp_path / "dense.safetensors", dense={"out"})
    reader, delta = decoded(path)
    writer = prepare_delta(m, delta)
    assert [w.mode for w in writer.parts] == ["direct", "direct"]  # scatters, then the loader
    if when == "before":

        def refuse():
            raise DirectReloadError("injected refusal (nothing was written)")

        writer.parts[1].run = refuse
    else:
        load = m.load_weights

        def load_then_fail(weights):
            load(weights)
            raise RuntimeError("injected loader fault")

        m.load_weights = load_then_fail
    with pytest.raises(DirectReloadError, match="injected") as info:
        writer.run()
    state = bridge_state(m)
    if when == "before":
        assert state.undefined is None, state.undefined
        assert "every writer that ran was undone" in str(info.value)
        assert_bits(m, a)
    else:
        assert state.undefined and "injected loader fault" in state.undefined
        assert torch.equal(m.out.detach().view(torch.int16), b["out"].view(torch.int16))
    assert writer.undo_log is None
    reader.close()


def test_a_complete_write_failing_after_its_session_finished_is_undefined(monkeypatch) -> None:
    """The write protocol's contract: a writer that fails leaves the model on its previous bits
    or undefined. FAULT INJECTION (nothing outside can make it fail there): learning the write
    map, after a complete write's session finished, raises; the new bits are in place, so the
    model must be undefined, naming the error, not taken for the old version."""
    import weight_bridge.direct.session as session

    a, b = ckpt(0), ckpt(1)
    m = engine_model(a)

    def fail(*args, **kwargs):
        raise MemoryError("injected: learning the write map")

    monkeypatch.setattr(session.WriteMapLearner, "finish", fail)
    with pytest.raises(DirectReloadError, match="injected"):
        direct_reload(m, b)
    assert "MemoryError: injected" in (bridge_state(m).undefined or ""), bridge_state(m).undefined


def _splitmix64(x: int) -> int:
    """The documented weight hash in plain Python (weight_bridge.exact's module docstring)."""
    m = (1 << 64) - 1
    x = (x + 0x1E3779B97F4A7C15) & m  # the golden ratio's, top bit cleared
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return (x ^ (x >> 31)) | 1


def test_the_fingerprint_weights_are_the_documented_hash_at_any_index() -> None:
    """The format pins ``w(i) = A[i mod 65536] * B[i // 65536]`` (a delta written by one
    version is checked by another): the engine's table look-ups equal the hash computed
    from its definition, past the table's first size (1024 blocks) too."""
    from weight_bridge.exact import fingerprint_change, weights_at

    idx = [0, 1, 65535, 65536, 1 << 26, (1 << 26) + 12345, (3 << 26) + 7, (1 << 31) + 5]
    low, mask = 1 << 16, (1 << 64) - 1
    want = [(_splitmix64(i % low) * _splitmix64(i // low + low)) & mask for i in idx]
    got = [w & mask for w in weights_at(torch.tensor(idx, dtype=torch.int64)).tolist()]
    assert got == want
    old = torch.zeros(len(idx), dtype=torch.bfloat16)
    new = torch.ones(len(idx), dtype=torch.bfloat16)
    one = int(new[0].view(torch.int16))
    assert fingerprint_change(torch.tensor(idx), old, new) == sum(want) * one & mask


@pytest.mark.parametrize("linear", [True, False])
def test_a_segment_maps_sorted_indices_to_their_live_elements(linear: bool) -> None:
    """A linear segment (a first-dimension slice) shifts the indices it holds; any other (a
    column slice, as a row-parallel shard) is solved coordinate by coordinate. Either way the
    live elements written from the located indices equal the loader's own copy of the view."""
    from weight_bridge.direct.write_map import Segment

    src = torch.arange(48, dtype=torch.float32).view(8, 6)
    view = src[2:5] if linear else src[:, 1:4]
    live = torch.zeros(64)
    dst = live[10 : 10 + view.numel()].view(view.shape)
    seg = Segment(live, view.storage_offset(), view.stride(), 10, dst.stride(), view.shape)
    assert seg.linear is linear
    flat = torch.tensor([0, 3, 7, 13, 14, 17, 20, 26, 29, 40, 47])  # some held, some not
    held, where = seg.positions(flat)
    values = held.take(src.view(-1)[flat])
    for start, end, at in where.chunks(torch.device("cpu")):
        live[at] = values[start:end]
    expected = torch.zeros(64)
    expected[10 : 10 + view.numel()].view(view.shape).copy_(view)
    hit = live != 0
    assert torch.equal(live[hit], expected[hit]) and int(hit.sum()) == where.numel
    in_view = [i for i in flat.tolist() if i and bool((view == float(i)).any())]
    assert held.take(flat).numel() == len(in_view)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.float32, torch.bfloat16])
def test_two_flips_of_a_high_bit_never_cancel_in_the_fingerprint(dtype) -> None:
    """Sign (top) and exponent (next) bit flips at two random places of a tensor change its
    fingerprint, for every element size: an 8-byte element weighted whole made any two
    top-bit flips cancel (2**63 times an odd weight is 2**63); its halves do not. The
    O(changed) update agrees with a full recomputation."""
    g = torch.Generator().manual_seed(0)
    n = 4099
    t = (torch.randn(n, generator=g, dtype=torch.float64) * 100).to(dtype)
    bits = bits_of(t)
    size = 8 * t.element_size()
    before = exact_fingerprint(t)
    for trial in range(100):
        at = torch.randperm(n, generator=g)[:2].sort().values
        bit = size - 1 - trial % 2  # the sign bit, then the highest exponent bit
        flipped = bits.clone()
        flipped[at] ^= torch.tensor(1, dtype=bits.dtype) << bit
        new = flipped.view(dtype) if dtype.is_floating_point else flipped
        after = exact_fingerprint(new)
        assert after != before, (trial, at.tolist(), bit)
        change = fingerprint_change(at, t[at], new[at])
        assert (before + change) & ((1 << 64) - 1) == after
