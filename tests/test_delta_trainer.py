"""Delta sync, the trainer side: the engine's dtype, the reference copy, the delta and keyframe
files, and when each is written.

The unit tests drive the callback's own parts (``Gatherer``, ``SyncClock``, ``DeltaState``) the
way ``VLLMWeightSync._save`` does, on a small torch model trained with AdamW at lr 1e-5, and
write real files. They play the engine by decoding each file with the format's own reader
(``read_delta``) and applying it to the tensors the last file left: after every sync that must
be the trainer's current cast, bit for bit, and every fingerprint the file records must be the
exact fingerprint of the tensor it stands for. The last test is a real ``Trainer`` pushing into a
real engine (skipped until the engine reports the dtypes it holds).
"""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

import weight_bridge.delta.reference as reference_mod
from callbacks import CheckpointFiles, CheckpointNames, EngineSpec, Schedule, VLLMWeightSync
from callbacks.schedule import SyncClock
from weight_bridge.checkpoint import BASE_VERSION_KEY, CheckpointReader
from weight_bridge.delta.choice import DeltaChoice
from weight_bridge.delta.format import (
    DELTA_KEY,
    FINGERPRINTS_KEY,
    is_delta,
    read_delta,
    sparse_bytes,
)
from weight_bridge.delta.keyframes import DELTA_EVERY_K
from weight_bridge.delta.reference import Reference
from weight_bridge.delta.state import DeltaState
from weight_bridge.exact import bits_of, exact_fingerprint, format_fingerprint
from weight_bridge.sync import Sender
from weight_bridge.sync.collective import Collective
from weight_bridge.sync.gather import Gatherer
from weight_bridge.sync.names import ENGINE
from weight_bridge.sync.transport import FileTransport

BF16 = "bfloat16"


class Policy(nn.Module):
    """Small, with a tensor of several 65536-element blocks, a bias, a norm, an integer buffer
    and a frozen embedding."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = nn.Embedding(96, 64)
        self.up = nn.Linear(64, 2100)  # 134400 elements: three blocks, the last one partial
        self.norm = nn.LayerNorm(2100)
        self.down = nn.Linear(2100, 8)
        self.register_buffer("count", torch.arange(5, dtype=torch.int64))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        self.embed.weight.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(torch.relu(self.up(self.embed(ids)))))


def train(model: Policy, optimizer: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (16,), generator=g)
    loss = model(ids).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def cast_state(model: nn.Module, dtypes: dict[str, str]) -> dict[str, torch.Tensor]:
    """The trainer's current cast: each tensor in the dtype the engine reported."""
    out = {}
    for name, t in model.state_dict().items():
        dtype = getattr(torch, dtypes[name]) if name in dtypes else t.dtype
        out[name] = t.detach().to(dtype) if t.dtype.is_floating_point else t.detach().clone()
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits_of(a), bits_of(b))


class Syncer:
    """The callback's save path without Lightning (what ``VLLMWeightSync._save`` does), and an
    engine's view of the files: the tensors held after applying each one."""

    def __init__(self, tmp_path: Path, model: nn.Module, schedule: Schedule) -> None:
        self.dir = tmp_path
        self.module = SimpleNamespace(model=model)
        self.gatherer = Gatherer(CheckpointNames(), "model", None, fsync=False)
        self.clock = SyncClock(schedule)
        self.deltas = DeltaState(self.clock, self.gatherer.engine)
        files = FileTransport(self.gatherer, CheckpointFiles(), self.deltas)  # writes no file
        self.sender = Sender(self.deltas, files)
        self.collective = Collective(None)  # replicated, one rank: no agreement is asked for
        self.held: dict[str, torch.Tensor] = {}
        self.version: str | None = None
        self.deltas.start(tmp_path)
        self.clock.at_train_start(0)

    def save(self, step: int) -> tuple[Path, str, float | None]:
        last = self.clock.last_pushed_step
        turn = self.sender.turn(None if last is None else str(last))
        kind, based = turn.kind, turn.based
        changing = kind == "partial" or (kind == "delta" and self.clock.schedule.skip_frozen)
        plan = self.gatherer.plan(None, self.module, changing, True, based and kind != "delta")
        metadata = {"step": str(step), "version": str(step)}
        if plan.partial or kind == "delta":
            metadata.update(turn.metadata)
        path = self.dir / f"step-{step:08d}.safetensors"
        sink = partial(turn.opener, tracked=plan.tracked)
        saved = self.gatherer.stream(plan, path, metadata, self.collective, [0], sink)
        assert saved is not None
        changed = self.deltas.changed_fraction()
        self.clock.last_pushed_step = step
        self.clock.pushed(plan.partial, kind == "delta", saved.bytes, based)
        return path, kind, changed

    def push(self, path: Path, dtypes: dict[str, str]) -> dict[str, str]:
        """Apply the file as an engine holding ``dtypes`` would (a keyframe's tensors cast on
        load, a delta's values written as they are); report ``dtypes`` after a complete one.
        Every fingerprint the file records must be that of the full tensor it stands for."""
        with CheckpointReader(path) as reader:
            meta = dict(reader.metadata)
            tensors = {n: t.clone() for n, t in reader.tensors()}
        prints: dict[str, str] = json.loads(meta.get(FINGERPRINTS_KEY, "{}"))
        if is_delta(meta):
            delta = read_delta(str(path), meta, tensors)
            assert delta.base == self.version, (delta.base, self.version)
            for name, t in delta.dense:
                assert t.dtype == self.held[name].dtype, name
                self.held[name] = t.clone()
            for name, sparse in delta.sparse.items():
                flat = self.held[name].clone().reshape(-1)
                assert sparse.values.dtype == flat.dtype, name
                flat[sparse.indices] = sparse.values
                self.held[name] = flat.reshape(sparse.shape)
            kind = "delta"
            for name, fp in prints.items():
                assert fp == format_fingerprint(exact_fingerprint(self.held[name])), name
        else:
            assert meta.get(BASE_VERSION_KEY) in (None, self.version)
            kind = "partial" if BASE_VERSION_KEY in meta else "complete"
            for name, fp in prints.items():
                assert fp == format_fingerprint(exact_fingerprint(tensors[name])), name
            if kind == "complete":
                self.held = {}
            for name, t in tensors.items():
                dtype = getattr(torch, dtypes[name]) if name in dtypes else t.dtype
                self.held[name] = t.to(dtype)
        self.version = meta["version"]
        self.deltas.pushed(kind, dtypes if kind == "complete" else {})
        return prints


def test_every_delta_applied_to_the_last_push_is_the_trainers_cast(tmp_path, monkeypatch):
    """Twelve syncs under AdamW at lr 1e-5 into a bf16 engine: the first complete in fp32 (no
    report yet), the next a keyframe in bf16, then deltas, each reproducing the trainer's bf16
    cast bit for bit. Chunks smaller than a tensor, so the walk crosses chunk boundaries."""
    monkeypatch.setattr(reference_mod, "CHUNK", 50_000)
    torch.manual_seed(0)
    model = Policy()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    engine_dtypes = {n: BF16 for n, t in model.state_dict().items() if t.dtype.is_floating_point}
    syncer = Syncer(tmp_path, model, Schedule(delta="on"))
    syncer.clock.delta_budget = 100.0  # no keyframe by bytes: deltas all along
    kinds, fractions = [], []
    for step in range(12):
        if step:
            train(model, optimizer, step)
        path, kind, changed = syncer.save(step)
        prints = syncer.push(path, engine_dtypes)
        kinds.append(kind)
        fractions.append(changed)
        want = cast_state(model, engine_dtypes)
        assert set(syncer.held) == set(want)
        for name, t in want.items():
            assert same_bits(syncer.held[name], t), (step, name)
        if kind == "complete":
            assert set(prints) == set(want)
        if kind == "partial":  # what training can change; the engine keeps its embedding
            assert set(prints) == set(want) - {"embed.weight"}
    assert kinds == ["complete", "partial"] + ["delta"] * 10
    assert syncer.held["up.weight"].dtype == torch.bfloat16
    assert all(0 < f < 1 for f in fractions[2:]), fractions  # some, not all, bf16 values moved
    assert syncer.deltas.reference.names  # the trainable tensors, not the frozen embedding
    assert "embed.weight" not in syncer.deltas.reference.names


def test_a_delta_is_sparse_or_dense_whichever_is_smaller_and_may_be_empty(tmp_path):
    model = Policy()
    model.embed.weight.requires_grad_(True)
    dtypes = {n: BF16 for n, t in model.state_dict().items() if t.dtype.is_floating_point}
    syncer = Syncer(tmp_path, model, Schedule(delta="on", skip_frozen=False))
    syncer.deltas.pushed("complete", dtypes)  # as if the engine had reported already
    syncer.push(syncer.save(0)[0], dtypes)  # a keyframe in bf16

    path, kind, changed = syncer.save(1)  # nothing trained: a delta of no tensors
    assert kind == "delta" and changed == 0.0
    with CheckpointReader(path) as reader:
        assert reader.metadata[DELTA_KEY] == "1" and reader.metadata["version"] == "1"
        assert reader.metadata[BASE_VERSION_KEY] == "0" and not reader.specs()
    syncer.push(path, dtypes)

    with torch.no_grad():
        model.up.weight.view(-1)[::1000] += 1.0  # 135 of 134400: sparse
        model.norm.weight.mul_(-1.0)  # every element: dense
    path, kind, _ = syncer.save(2)
    assert kind == "delta"
    with CheckpointReader(path) as reader:
        names = set(reader.specs())
        size = reader.nbytes
    assert names == {
        "up.weight@delta.blocks",
        "up.weight@delta.offsets",
        "up.weight@delta.values",
        "norm.weight",
    }
    assert size == sparse_bytes(134400, 135, 2) + 2100 * 2
    syncer.push(path, dtypes)
    for name, t in cast_state(model, dtypes).items():
        assert same_bits(syncer.held[name], t), name


def test_lora_merged_weights_are_diffed_as_merged(models, tmp_path):
    """PEFT LoRA on q_proj and v_proj of a tied Qwen2: each delta carries the merged weights'
    changes, and applied, gives the trainer's merged weights cast to bf16, bit for bit."""
    import peft
    from transformers import AutoModelForCausalLM

    from weight_bridge.sync.changed import materialize, sync_state

    model = AutoModelForCausalLM.from_pretrained(models["qwen2_A"], dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(model, config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def merged() -> dict[str, torch.Tensor]:
        return {
            n: t.to(torch.bfloat16)
            for n, t in materialize(sync_state(model, model.state_dict(), False))
        }

    dtypes = {n: BF16 for n in merged()}
    syncer = Syncer(tmp_path, model, Schedule(delta="on"))
    ids = torch.randint(4, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    kinds = []
    for step in range(4):
        if step:
            optimizer.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
        path, kind, changed = syncer.save(step)
        syncer.push(path, dtypes)
        kinds.append(kind)
        want = merged()
        assert syncer.held and set(syncer.held) <= set(want)
        for name, t in syncer.held.items():
            assert same_bits(t, want[name]), (step, name)
        if kind == "delta":
            with CheckpointReader(path) as reader:
                names = {n.partition("@")[0] for n in reader.specs()}
            assert names and all(n.endswith(("q_proj.weight", "v_proj.weight")) for n in names)
    assert kinds == ["complete", "partial", "delta", "delta"]
    kept = syncer.deltas.reference.names  # what training can change: the merged weights only
    assert kept and all(n.endswith(("q_proj.weight", "v_proj.weight")) for n in kept)


def test_reference_diff_is_exact_for_nan_and_signed_zero() -> None:
    ref = Reference()
    t = torch.zeros(100)
    t[1:4] = torch.tensor([1.0, float("nan"), 2.0])
    ref.store("x", t, torch.bfloat16)
    new = t.clone()
    new[0], new[3] = -0.0, 2.0 + 2**-12  # -0 differs from 0, a NaN from itself not, and
    change = ref.diff("x", new, torch.bfloat16)  # 2 + 2**-12 rounds to 2 in bf16 (even)
    assert change is not None and change.changed == 1 and change.sparse is not None
    assert change.fingerprint == exact_fingerprint(new.to(torch.bfloat16))
    assert ref.diff("x", torch.zeros(5), torch.bfloat16) is None  # another shape: no delta
    assert ref.diff("x", new, torch.float32) is None  # another dtype: no delta
    dense = ref.diff("x", new, torch.bfloat16, sparse=False)
    assert dense is not None and dense.changed == 0  # nothing left to change


def test_an_aborted_delta_leaves_no_file_and_the_next_sync_is_a_keyframe(tmp_path):
    """The delta file is written last, after every tensor was diffed (and the reference
    updated): a real failure there (its path is taken by a directory, so the rename fails)
    must leave no file and no trusted reference."""
    model = Policy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    syncer = Syncer(tmp_path, model, Schedule(delta="on"))
    syncer.push(syncer.save(0)[0], {})
    train(model, optimizer, 1)
    (tmp_path / "step-00000001.safetensors").mkdir()
    with pytest.raises(OSError):
        syncer.save(1)
    assert not [p for p in tmp_path.iterdir() if p.is_file() and "00000001" in p.name]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary
    assert syncer.deltas.reference.names == []
    syncer.deltas.failed()  # what the callback does on any failed sync
    path, kind, _ = syncer.save(2)
    assert kind == "complete"
    syncer.push(path, {})
    for name, t in cast_state(model, {}).items():
        assert same_bits(syncer.held[name], t), name


def test_after_a_failed_sync_no_file_is_written_in_the_dtypes_the_engine_reported_before(
    tmp_path,
):
    """A failed sync may mean the engine changed (restarted in another dtype, say): what it
    reported before is forgotten with the reference, so the next file is in the trainer's
    dtype, and once the engine reports again its new dtypes are the ones written."""
    model = Policy()
    syncer = Syncer(tmp_path, model, Schedule(delta="on"))
    floating = [n for n, t in model.state_dict().items() if t.is_floating_point()]
    syncer.push(syncer.save(0)[0], dict.fromkeys(floating, BF16))  # a bf16 engine
    path, kind, _ = syncer.save(1)
    with CheckpointReader(path) as reader:
        assert {str(t.dtype) for n, t in reader.tensors() if n in floating} == {"torch.bfloat16"}
    syncer.deltas.failed()  # e.g. that engine went away; a float16 one took its place
    path, kind, _ = syncer.save(2)
    assert kind == "complete"
    with CheckpointReader(path) as reader:
        written = {str(t.dtype) for n, t in reader.tensors() if n in floating}
    assert written == {"torch.float32"}, written  # the trainer's, not the old engine's bf16
    syncer.held = {}
    syncer.push(path, dict.fromkeys(floating, "float16"))
    path, kind, _ = syncer.save(3)
    with CheckpointReader(path) as reader:
        assert {str(t.dtype) for n, t in reader.tensors() if n in floating} == {"torch.float16"}


def test_a_keyframe_records_every_tensors_fingerprint(tmp_path):
    model = Policy()
    syncer = Syncer(tmp_path, model, Schedule(delta="on"))
    path, kind, _ = syncer.save(0)
    with CheckpointReader(path) as reader:
        reader.verify_hash()  # the header was rewritten before the rename: the hash holds
        prints = json.loads(reader.metadata[FINGERPRINTS_KEY])
        tensors = dict(reader.tensors())
        assert set(prints) == set(tensors)
        for name, t in tensors.items():
            assert prints[name] == format_fingerprint(exact_fingerprint(t)), name
    # the frozen embedding is fingerprinted and written, but not kept for deltas
    assert "embed.weight" in prints and "embed.weight" not in syncer.deltas.reference.names


def test_engine_dtype_names_and_what_cannot_be_cast() -> None:
    from weight_bridge.sync.changed import sync_state

    model = Policy()
    state = sync_state(model, model.state_dict(), False)
    reported = {"up.weight": BF16, "up.bias": "float8_e4m3fn", "count": BF16, "norm.weight": "x"}
    dtypes = {e.name: e.dtype for e in CheckpointNames().entries(state, reported)[0]}
    assert dtypes["up.weight"] == torch.bfloat16
    assert dtypes["up.bias"] == torch.float32  # fp8 needs scales: not a cast, kept
    assert dtypes["count"] == torch.int64  # integers are never cast
    assert dtypes["norm.weight"] == dtypes["down.weight"] == torch.float32  # unknown, unreported
    fixed = CheckpointNames(dtype="float16").entries(state, reported)[0]
    assert {e.dtype for e in fixed if e.name != "count"} == {torch.float16}
    trainers = CheckpointNames(dtype=None).entries(state, reported)[0]
    assert {e.dtype for e in trainers if e.name != "count"} == {torch.float32}


# -- when a keyframe is due --------------------------------------------------------------------


def walk(
    clock: SyncClock, accepts: bool, steps: int, nbytes=lambda kind: 100, fail=(), cost=None
) -> str:
    """The kinds of ``steps`` syncs (C complete, P partial, d delta; a keyframe that keeps the
    reference copy in upper case too); ``cost(kind)``: each sync's seconds, as measured."""
    out = ""
    for step in range(steps):
        kind = clock.kind(accepts)
        out += {"complete": "C", "partial": "P", "delta": "d"}[kind]
        if step in fail:
            clock.failed()
            continue
        based = clock.delta_on(accepts) and kind != "delta"
        seconds = cost(kind) if cost is not None else None
        clock.pushed(kind == "partial", kind == "delta", nbytes(kind), based, seconds)
    return out


def test_keyframes_first_after_a_failure_and_every_k() -> None:
    clock = SyncClock(Schedule(delta="on", full_every_k=4))
    clock.at_train_start(0)
    once = walk(clock, False, 9, nbytes=lambda k: 0 if k == "delta" else 1, fail={5})
    assert once == "Cddd" + "Cd" + "Cdd"  # the delta of step 5 failed
    clock = SyncClock(Schedule(delta="on"))  # full_every_k None: every DELTA_EVERY_K
    clock.at_train_start(0)
    kinds = walk(clock, False, 2 * DELTA_EVERY_K + 1, nbytes=lambda k: 0)
    assert kinds == ("C" + "d" * (DELTA_EVERY_K - 1)) * 2 + "C"
    clock.at_train_start(7)  # a resume: a keyframe first
    assert clock.kind(True) == "complete"


def test_keyframe_past_the_byte_budget() -> None:
    clock = SyncClock(Schedule(delta="on"))
    clock.delta_budget = 0.25  # the library's budget is 1.0: a lower one, to reach it sooner
    clock.at_train_start(0)
    # keyframes of 100 bytes (C and P), deltas of 10: past 25 after the third delta
    kinds = walk(clock, True, 10, nbytes=lambda k: 10 if k == "delta" else 100)
    assert kinds == "Cddd" + "Pddd" + "Pd"


def test_auto_keeps_the_kind_measured_cheaper_and_never_deltas_through_host_memory() -> None:
    """``delta="auto"`` (the choice is a pure function of the costs the sender measured, so
    they are given here): after the engine accepts deltas, a full sync is measured, a keyframe
    keeps the reference, a delta probes; the cheaper kind is kept. A probe that loses sends the
    run back to full syncs for 2, 4, ... syncs; a delta that costs more than the last full sync
    ends the deltas. Where host memory carries every byte no delta is ever sent, and no
    reference copy is kept."""

    def clock() -> SyncClock:
        auto = SyncClock(Schedule(delta="auto"))
        auto.delta_budget = 100.0
        auto.at_train_start(0)
        return auto

    cheap = clock()
    assert walk(cheap, False, 4) == "CPPP"  # no report of dtypes: partial syncs as before
    assert not cheap.has_base
    full_1s = {"partial": 1.0, "complete": 1.0}
    # a full sync measured, a keyframe keeping the reference, a probe, then deltas
    assert walk(cheap, True, 6, cost=lambda k: {**full_1s, "delta": 0.5}[k]) == "PPdddd"
    assert cheap.described("delta")["why"].startswith("a delta measured cheaper (0.500 s")
    # deltas that grow past the last full sync's cost: back to full syncs, re-probed later
    assert walk(cheap, True, 4, cost=lambda k: {**full_1s, "delta": 2.0}[k]) == "dPPP"
    costly = clock()
    walk(costly, False, 1)
    kinds = walk(costly, True, 20, cost=lambda k: {**full_1s, "delta": 3.0}[k])
    assert kinds == "PPd" + "PP" + "Pd" + "PPPP" + "Pd" + "P" * 7, kinds  # waits 2, 4, 8
    why = costly.described("partial")["why"]
    assert why.startswith("a full sync measured cheaper (1.000 s against 3.000 s"), why
    ram = clock()
    ram.choice = DeltaChoice("host memory carries every byte")
    assert walk(ram, False, 1) + walk(ram, True, 6, cost=lambda k: 0.001) == "CPPPPPP"
    assert not ram.has_base and ram.described("partial")["why"] == "host memory carries every byte"
    off = SyncClock(Schedule(delta=False, skip_frozen=False))
    off.at_train_start(0)
    assert walk(off, True, 4) == "CCCC"
    assert Schedule(delta=True).delta == "on" and Schedule(delta=False).delta == "off"
    with pytest.raises(ValueError, match="delta"):
        Schedule(delta="sometimes")


def test_a_change_of_the_engines_dtypes_makes_the_next_sync_a_keyframe() -> None:
    gatherer = Gatherer(CheckpointNames(), "model", None)
    clock = SyncClock(Schedule(delta="on"))
    deltas = DeltaState(clock, gatherer.engine, gatherer.names.dtype == ENGINE)
    clock.at_train_start(0)
    clock.pushed(False, False, 100, based=True)
    assert clock.kind() == "delta"
    deltas.pushed("complete", {"w": BF16})  # the first report: a cast in another dtype
    assert gatherer.engine.known == {"w": BF16} and deltas.accepts
    assert clock.kind() == "partial"
    clock.pushed(True, False, 50, based=True)
    deltas.pushed("complete", {"w": BF16})  # the same: nothing to redo
    assert clock.kind() == "delta"
    deltas.pushed("complete", {})  # an engine that no longer reports takes no delta
    assert not deltas.accepts


# -- vLLM's trainer API (WeightBridgeTrainer) into a real engine ---------------------------------


def _api_sender(engine, directory: Path, model: nn.Module, rank: int = 0, **deltas):
    """vLLM's trainer side over ``model`` (vLLM's own ``ModuleSource``), pushing into
    ``engine``; ``deltas``: the init info's delta options."""
    from vllm.distributed.weight_transfer.base import ModuleSource

    from weight_bridge.vllm.clients.trainer_api import (
        WeightBridgeTrainer,
        WeightBridgeTrainerInitInfo,
    )

    info = WeightBridgeTrainerInitInfo(directory=str(directory), rank=rank, **deltas)
    return WeightBridgeTrainer.trainer_init(info, client=engine, source=ModuleSource(model))


def _nudge(model: nn.Module, seed: int, scale: float = 2e-4) -> None:
    """A small step on the fp32 weights: a few percent of their bf16 casts change."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + scale * torch.randn(p.shape, generator=g))


def _assert_holds_bf16_cast(engine, model: nn.Module) -> None:
    """The engine's fingerprint of every tensor it holds is that of the trainer's bf16 cast."""
    (held,) = engine.fingerprints()
    params = dict(model.named_parameters())
    assert held and set(held) <= set(params), sorted(set(held) - set(params))
    for name, fp in held.items():
        want = exact_fingerprint(params[name].detach().to(torch.bfloat16))
        assert fp == format_fingerprint(want), name


def _file(path: Path) -> tuple[dict[str, str], dict[str, torch.dtype], int]:
    """A sent file's metadata, its tensors' dtypes, and its size."""
    with CheckpointReader(path) as reader:
        meta = dict(reader.metadata)
        dtypes = {n: t.dtype for n, t in reader.tensors()}
    return meta, dtypes, path.stat().st_size


def test_two_trainers_stamping_the_same_labels_never_cross(models, shared_engine, tmp_path):
    """Two ``WeightBridgeTrainer``s in different directories, one engine: both label their
    n-th send ``step-0000000n``. The second's keyframe replaces the first's weights under the
    same label, so a delta of the first on ``step-00000002`` names the right label but the
    wrong weights: refused by the lineage of its base (a digest of the fingerprints it was
    written against), with nothing written, even for tensors the delta does not carry. On its
    own chain a trainer's deltas apply."""
    from transformers import AutoModelForCausalLM

    from weight_bridge.delta.format import BASE_LINEAGE_KEY
    from weight_bridge.direct.errors import BaseVersionError

    engine = shared_engine("llama_A", dtype=BF16)
    first = AutoModelForCausalLM.from_pretrained(models["llama_A"], dtype=torch.float32)
    second = AutoModelForCausalLM.from_pretrained(models["llama_B"], dtype=torch.float32)
    one = _api_sender(engine, tmp_path / "one", first, delta="on")
    two = _api_sender(engine, tmp_path / "two", second, delta="on")
    for sender in (one, two):
        sender.send_weights()  # step-00000001: a keyframe in fp32 (nothing reported yet)
        sender.send_weights()  # step-00000002: a keyframe in the engine's bf16
    assert engine.version == "step-00000002"  # the second's weights, under the shared label
    (held,) = engine.fingerprints()
    _nudge(first, 1)
    with pytest.raises(BaseVersionError, match="lineage") as refused:
        one.send_weights()  # a delta on "step-00000002": the first's, not what is served
    assert "another writer's weights" in str(refused.value)
    assert engine.version == "step-00000002" and engine.fingerprints() == [held]
    _nudge(second, 2)
    path = two.send_weights()
    assert path is not None
    meta, _, _ = _file(path)
    assert is_delta(meta) and BASE_LINEAGE_KEY in meta  # its own chain: applies
    _assert_holds_bf16_cast(engine, second)


def test_the_trainer_api_init_info_checks_its_delta_options() -> None:
    from weight_bridge.vllm.clients.trainer_api import WeightBridgeTrainerInitInfo

    assert WeightBridgeTrainerInitInfo(rank=0).delta == "auto"
    assert WeightBridgeTrainerInitInfo(rank=0, delta=True).delta == "on"  # type: ignore[arg-type]
    for bad in ({"delta": "sometimes"}, {"full_every_k": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            WeightBridgeTrainerInitInfo(rank=0, **bad)  # type: ignore[arg-type]


@pytest.mark.every_vllm
def test_the_trainer_api_sends_deltas_a_bf16_engine_holds_bit_for_bit(
    models, shared_engine, tmp_path
):
    """``WeightBridgeTrainer`` (vLLM's trainer API, ``delta="on"``) on a float32
    Llama whose weights move a little before each send, into a bf16 engine: a keyframe in fp32
    (nothing reported yet), a bf16 keyframe (every tensor's fingerprint in its header),
    then delta files on the version the engine stamped last, far smaller than the keyframe;
    after every send the engine holds the trainer's bf16 cast bit for bit. A delta whose base
    the engine no longer serves, and one with a NaN, are refused by name; the next send is a
    keyframe and lands. A partial send is a plain file, and a keyframe follows it. With
    ``delta="off"`` every send is a complete file. A non-sender rank writes nothing."""
    from transformers import AutoModelForCausalLM

    from weight_bridge.direct import DirectReloadError
    from weight_bridge.direct.errors import BaseVersionError

    llama_a = models["llama_A"]
    engine = shared_engine("llama_A", dtype=BF16)
    model = AutoModelForCausalLM.from_pretrained(llama_a, dtype=torch.float32)
    sender = _api_sender(engine, tmp_path / "api", model, delta="on")
    numel = sum(p.numel() for p in model.parameters())
    step = 0

    def send(kind: str, **kwargs) -> tuple[dict[str, str], dict[str, torch.dtype], int]:
        nonlocal step
        step += 1
        _nudge(model, step)
        path = sender.send_weights(version=kwargs.pop("version", f"s{step}"), **kwargs)
        assert path is not None and sender.last_version == engine.version
        meta, dtypes, size = _file(path)
        got = "delta" if is_delta(meta) else "keyframe" if FINGERPRINTS_KEY in meta else "plain"
        assert got == kind, (step, got, kind)
        assert sender.last_report is not None and sender.last_report.delta == (kind == "delta")
        _assert_holds_bf16_cast(engine, model)
        return meta, dtypes, size

    _, dtypes, first = send("keyframe")  # no report yet: the trainer's dtype, fingerprinted
    assert set(dtypes.values()) == {torch.float32}
    _, dtypes, keyframe = send("keyframe")  # the engine's dtype from now on
    assert set(dtypes.values()) == {torch.bfloat16}
    assert math.isclose(first / keyframe, 2.0, rel_tol=0.05)
    assert sender.sender.deltas.reference.nbytes == 2 * numel  # one bf16 copy of every tensor sent
    for _ in range(3):
        before = engine.version
        meta, _, size = send("delta")
        assert meta[BASE_VERSION_KEY] == before and size < keyframe / 4, (size, keyframe)
    meta, _, _ = send("delta", version=None)  # labelled by its file name, as any checkpoint
    assert "version" not in meta and engine.version == f"step-{sender.rounds:08d}"

    # a delta on a base the engine does not serve: refused, nothing written; then a keyframe
    engine.push(llama_a / "model.safetensors", version="elsewhere")
    with pytest.raises(BaseVersionError):
        send("delta")
    assert engine.version == "elsewhere"
    # after a failure nothing the engine reported is trusted (it may be another engine): a
    # keyframe in the trainer's dtype, then one in the dtypes the engine reports again
    _, dtypes, _ = send("keyframe")
    assert set(dtypes.values()) == {torch.float32}
    _, dtypes, _ = send("keyframe")
    assert set(dtypes.values()) == {torch.bfloat16}
    send("delta")

    # a NaN in a delta: refused by name, the engine keeps its version; then a keyframe
    name, weight = next((n, p) for n, p in model.named_parameters() if p.ndim == 2)
    served = engine.version
    with torch.no_grad():
        good = weight[0, 0].item()
        weight[0, 0] = float("nan")
    with pytest.raises(DirectReloadError) as refused:
        sender.send_weights(version="nan")
    assert name in refused.value.problems and engine.version == served
    with torch.no_grad():
        weight[0, 0] = good
    send("keyframe")

    # a partial send is a plain file on the last version; the next complete send a keyframe
    part = sender.send_weights(version="part", names=[name])
    assert part is not None and engine.version == "part"
    meta, _, _ = _file(part)
    assert not is_delta(meta) and FINGERPRINTS_KEY not in meta and BASE_VERSION_KEY in meta
    _assert_holds_bf16_cast(engine, model)
    send("keyframe")
    send("delta")

    other = _api_sender(engine, tmp_path / "api", model, rank=1)  # takes part, writes nothing
    assert other.sender is None and other.send_weights(version="x") is None
    assert engine.version == f"s{step}"

    sender = _api_sender(engine, tmp_path / "off", model, delta="off")
    _, dtypes, _ = send("plain")
    assert set(dtypes.values()) == {torch.float32}  # a new trainer: nothing reported yet
    _, dtypes, _ = send("plain")
    assert set(dtypes.values()) == {torch.bfloat16} and sender.sender.deltas.reference.nbytes == 0
    sender.shutdown()


# -- a real Trainer into a real engine -----------------------------------------------------


def test_the_callback_and_the_trainer_api_are_one_sender(models, shared_engine, tmp_path):
    """One sender for both entries: the same training run (a real ``Trainer``, seeded), synced
    every step once by ``VLLMWeightSync`` and once by vLLM's trainer API (``WeightBridgeTrainer``
    called at the same steps, from a Lightning callback), leaves the same files (the same kind,
    every tensor bit for bit, whatever the header's labels) and the same engine state after
    every sync (every tensor's exact fingerprint, the same version label): a fp32 keyframe, a
    bf16 one once the engine reported its dtypes, then deltas."""
    from helpers import TinyLM, trainer

    engine = shared_engine("llama_A", dtype=BF16)

    def run(entry: str) -> list[tuple[str, dict[str, torch.Tensor], object, str]]:
        seen: list[tuple[str, dict[str, torch.Tensor], object, str]] = []
        torch.manual_seed(0)
        module = TinyLM(str(models["llama_A"]))
        sync = VLLMWeightSync(
            engine=engine,
            schedule=Schedule(skip_frozen=False, delta="on"),
            files=CheckpointFiles(dirpath=str(tmp_path / "callback"), keep_last_k=10),
        )
        api = _api_sender(engine, tmp_path / "api", module.model, delta="on", keep_last_k=10)

        class Send(Callback):  # the API's sends at the callback's steps, then what they left
            def on_train_start(self, trainer, pl_module) -> None:
                self._sent(trainer.global_step)

            def on_train_batch_end(self, trainer, pl_module, *args) -> None:
                self._sent(trainer.global_step)

            def _sent(self, step: int) -> None:
                if entry == "api":
                    path = api.send_weights(version=str(step))
                else:
                    path = Path(sync.history[-1]["checkpoint"])
                assert path is not None
                with CheckpointReader(path) as reader:
                    meta = dict(reader.metadata)
                    tensors = {n: t.clone() for n, t in reader.tensors()}
                kind = "delta" if is_delta(meta) else "keyframe"
                assert FINGERPRINTS_KEY in meta or kind == "delta"
                seen.append((kind, tensors, engine.fingerprints(), str(engine.version)))

        callbacks = [Send()] if entry == "api" else [sync, Send()]
        trainer(tmp_path / entry, callbacks, max_steps=3).fit(module)
        api.shutdown()
        return seen

    by_callback, by_api = run("callback"), run("api")
    assert [k for k, *_ in by_callback] == ["keyframe", "keyframe", "delta", "delta"]
    assert [k for k, *_ in by_api] == [k for k, *_ in by_callback]
    for a, b in zip(by_callback, by_api, strict=True):
        assert sorted(a[1]) == sorted(b[1])  # the same tensors (a delta's: indices, values)
        assert all(same_bits(a[1][n], b[1][n]) for n in a[1])
        assert a[2:] == b[2:]  # the engine's fingerprints, and its label


@pytest.mark.parametrize("steps", [6, pytest.param(200, marks=pytest.mark.slow)])
def test_a_trainer_pushes_deltas_a_bf16_engine_holds_bit_for_bit(
    models, shared_engine, engine_factory, tmp_path, steps
):
    """AdamW at lr 1e-5 on a float32 Llama, a bf16 engine, ``delta="on"``: a complete push
    (fp32: nothing reported yet), a bf16 keyframe, then deltas only (no keyframe is due in 200
    steps here); after each push the engine's fingerprint of every tensor it holds is that of
    the trainer's bf16 cast: no drift. At the end a fresh bf16 engine on the trainer's cast
    generates the same greedy tokens."""
    from helpers import TinyLM, greedy, model_dir_with, trainer

    class AdamLM(TinyLM):  # type: ignore[misc,valid-type]
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-5)

    engine = shared_engine("llama_A", dtype=BF16)  # shared: the first sync is complete anyway
    sync = VLLMWeightSync(
        engine=engine,
        schedule=Schedule(delta="on", full_every_k=10_000),
        files=CheckpointFiles(dirpath=str(tmp_path / "ws"), keep_last_k=20),
    )
    sync.clock.delta_budget = 1e6  # deltas all along
    seen: list[str] = []

    class Check(Callback):  # after the sync: the engine's bits against the trainer's cast
        def _check(self, pl_module) -> None:
            if len(sync.history) == len(seen):
                return
            record = sync.history[-1]
            (held,) = engine.fingerprints()
            state = pl_module.model.state_dict()
            dtypes = sync.gatherer.engine.known
            for name, fp in held.items():
                t = state[name]
                dtype = getattr(torch, dtypes.get(name, BF16)) if t.is_floating_point() else t.dtype
                assert fp == format_fingerprint(exact_fingerprint(t.to(dtype))), name
            seen.append("d" if record["delta"] else "k")

        def on_train_start(self, trainer, pl_module):
            self._check(pl_module)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self._check(pl_module)

    module = AdamLM(str(models["llama_A"]))
    trainer(tmp_path, [sync, Check()], max_steps=steps).fit(module)
    assert "".join(seen) == "kk" + "d" * (steps - 1)
    deltas = [h for h in sync.history if h["delta"]]
    assert all(0 <= h["changed"] < 1 for h in deltas)
    full = sync.history[1]["bytes"]
    assert all(h["bytes"] < full for h in deltas), [h["bytes"] for h in sync.history]
    assert math.isclose(sync.history[0]["bytes"] / full, 2.0, rel_tol=0.05)  # fp32, then bf16
    served = greedy(engine)
    cast = {n: t.to(torch.bfloat16) for n, t in module.model.state_dict().items()}
    fresh = engine_factory(model_dir_with(models["llama_A"], cast, tmp_path / "cast"), dtype=BF16)
    # tokens: a bf16 CPU engine's logprobs vary by about one bf16 step from run to run
    assert [g[0] for g in greedy(fresh)] == [g[0] for g in served]


class DeltaRankReport(Callback):
    """Under ``ddp_spawn`` each rank writes what it saw at the end: its syncs' kinds, whether
    its engine holds the trainer's cast bit for bit, and the host memory of its reference."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module):
        (sync,) = [cb for cb in trainer.callbacks if isinstance(cb, VLLMWeightSync)]
        engine = pl_module.vllm_engine
        (held,) = engine.fingerprints()
        dtypes = sync.gatherer.engine.known
        state = pl_module.model.state_dict()
        wrong = [
            name
            for name, fp in held.items()
            if fp
            != format_fingerprint(
                exact_fingerprint(state[name].to(getattr(torch, dtypes.get(name, BF16))))
            )
        ]
        report = {
            "version": engine.version,
            "kinds": "".join("d" if h["delta"] else "k" for h in sync.history),
            "held": len(held),
            "wrong": wrong,
            "reference_bytes": sync.deltas.reference.nbytes,
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


@pytest.mark.slow
def test_ddp_ranks_push_deltas_their_engines_hold_bit_for_bit(models, tmp_path, monkeypatch):
    """Two CPU ranks under ``ddp_spawn``, a bf16 engine each: rank 0 alone writes (and alone
    holds the reference copy), both push every file, and both engines end on the trainer's
    cast bit for bit after a keyframe and deltas."""
    from helpers import ENGINE_KWARGS, TinyLM, trainer

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    sync = VLLMWeightSync(
        engine=EngineSpec(
            model=str(models["llama_A"]), options={"engine_args": {**ENGINE_KWARGS, "dtype": BF16}}
        ),
        schedule=Schedule(delta="on"),
        files=CheckpointFiles(dirpath=str(tmp_path / "ws"), keep_last_k=10),
    )
    run = trainer(
        tmp_path,
        [sync, DeltaRankReport(tmp_path)],
        max_steps=4,
        devices=2,
        strategy="ddp_spawn",
    )
    run.fit(TinyLM(str(models["llama_A"]), lr=1e-3))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for report in ranks:
        assert report["version"] == 4 and report["kinds"] == "kkddd", report
        assert report["held"] and not report["wrong"], report
    assert ranks[0]["reference_bytes"] > 0 and ranks[1]["reference_bytes"] == 0
