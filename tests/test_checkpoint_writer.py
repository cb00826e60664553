"""The streamed checkpoint writer: header from metadata first, tensors one at a time in order.

Every refusal is checked for what it leaves behind: the file that was at the path, unchanged
(its hash still verifies), and no temporary file.
"""

from __future__ import annotations

import gc
import json
import struct
import weakref
from pathlib import Path

import pytest
import torch

from weight_bridge.checkpoint import (
    CheckpointError,
    CheckpointReader,
    CheckpointWriter,
    save_checkpoint,
)
from weight_bridge.checkpoint.format import HASH_KEY


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(32, 8, generator=g),
        "norm.weight": torch.randn(8, generator=g).to(torch.bfloat16),
        "empty": torch.zeros(0, 4),
        "layer.weight": torch.randn(8, 8, generator=g).t(),  # not contiguous
        "step": torch.tensor(7, dtype=torch.int64),
    }


def metas(ts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a sharded trainer knows before gathering: shapes and dtypes, no data."""
    return {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in ts.items()}


def temps(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]


@pytest.fixture
def previous(tmp_path: Path) -> tuple[Path, str]:
    """A good checkpoint already at the path, and its hash."""
    path = tmp_path / "policy.safetensors"
    return path, save_checkpoint({"old": torch.ones(3)}, path, {"version": "old"}).hash


def assert_untouched(path: Path, digest: str) -> None:
    with CheckpointReader(path) as reader:
        reader.verify_hash()
        assert reader.metadata[HASH_KEY] == digest and reader.metadata["version"] == "old"
    assert temps(path.parent) == []


def test_streamed_file_reads_back_and_its_hash_verifies(tmp_path: Path) -> None:
    ts = tensors()
    path = tmp_path / "c.safetensors"
    with CheckpointWriter(path, metas(ts), {"version": "3"}) as writer:
        assert writer.names == list(ts)
        for name, t in ts.items():
            writer.write(name, t)
        saved = writer.finish()
    assert saved.path == path and saved.bytes == sum(t.nbytes for t in ts.values())
    with CheckpointReader(path) as reader:
        reader.verify_hash()
        assert reader.metadata == {"version": "3", HASH_KEY: saved.hash}
        got = {n: t.clone() for n, t in reader.tensors()}
    assert list(got) == list(ts)
    for name, t in ts.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert temps(tmp_path) == []


def _layout(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """Each tensor's dtype tag, shape and bytes, parsed straight from the safetensors format (a
    little-endian u64 header length, the JSON header, the data section its offsets point into):
    no reader of this project in between."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    return {
        name: (entry["dtype"], entry["shape"], data[slice(*entry["data_offsets"])])
        for name, entry in header.items()
        if name != "__metadata__"
    }


def test_both_write_paths_store_what_safetensors_itself_stores(tmp_path: Path) -> None:
    """The reference is safetensors' own ``save_file`` and ``load_file``: the mapping wrapper
    and the stream store every tensor with the dtype tag, shape and bytes ``save_file`` gives
    it, and ``load_file`` reads back exactly the tensors, with the metadata."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    ts = tensors()
    ref = tmp_path / "ref.safetensors"
    save_file({n: t.contiguous() for n, t in ts.items()}, str(ref), metadata={"k": "v"})
    want = _layout(ref)
    save_checkpoint(ts, tmp_path / "a.safetensors", {"k": "v"})
    with CheckpointWriter(tmp_path / "b.safetensors", metas(ts), {"k": "v"}) as writer:
        for name, t in ts.items():
            writer.write(name, t)
        writer.finish()
    for path in (tmp_path / "a.safetensors", tmp_path / "b.safetensors"):
        assert _layout(path) == want, path.name
        got = load_file(str(path))
        assert got.keys() == ts.keys(), path.name
        for name, t in ts.items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape, (path.name, name)
            assert torch.equal(got[name], t), (path.name, name)
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata()
        assert metadata["k"] == "v" and set(metadata) == {"k", HASH_KEY}, path.name


def test_a_modules_state_dict_loads_back_into_torch(tmp_path: Path) -> None:
    """torch's ``state_dict`` is the reference: a module's state saved with ``save_checkpoint``
    and read with safetensors' ``load_file`` loads strictly into a fresh module, which then
    holds the same state and computes the same output."""
    from safetensors.torch import load_file
    from torch import nn

    def module(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)).to(
            torch.bfloat16
        )

    trained, fresh = module(0), module(1)
    state = trained.state_dict()
    save_checkpoint(state, tmp_path / "m.safetensors")
    fresh.load_state_dict(load_file(str(tmp_path / "m.safetensors")), strict=True)
    for name, t in fresh.state_dict().items():
        assert t.dtype == state[name].dtype and torch.equal(t, state[name]), name
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    assert torch.equal(fresh(x), trained(x))


def test_header_is_on_disk_before_the_first_tensor(tmp_path: Path) -> None:
    ts = tensors()
    writer = CheckpointWriter(tmp_path / "c.safetensors", metas(ts))
    (tmp,) = temps(tmp_path)
    raw = (tmp_path / tmp).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    assert len(raw) == 8 + n  # the header and nothing else yet
    assert [k for k in header if k != "__metadata__"] == list(ts)
    assert header["empty"]["data_offsets"] == header["empty"]["data_offsets"][:1] * 2
    assert header["step"]["data_offsets"][1] == writer.nbytes
    writer.abort()
    assert temps(tmp_path) == []


def test_the_writer_keeps_no_tensor_once_written(tmp_path: Path) -> None:
    """What lets a trainer free each gathered tensor: nothing in the writer refers to it."""
    specs = {f"t{i}": torch.empty(64, 64, device="meta") for i in range(3)}
    with CheckpointWriter(tmp_path / "c.safetensors", specs) as writer:
        for name in specs:
            t = torch.randn(64, 64)
            alive = weakref.ref(t)
            writer.write(name, t)
            del t
            gc.collect()
            assert alive() is None, name
        writer.finish()


@pytest.mark.parametrize(
    ("feed", "culprit", "words"),
    [
        (["norm.weight"], "norm.weight", r"out of order: 'embed.weight' comes first"),
        (["embed.weight", "embed.weight"], "embed.weight", "written twice"),
        (["embed.weight", "lm_head.weight"], "lm_head.weight", "not in the header"),
        (["embed.weight", "norm.weight", "empty", "layer.weight"], "step", "never written"),
    ],
)
def test_order_and_coverage_are_enforced_by_name(
    previous, feed: list[str], culprit: str, words: str
) -> None:
    path, digest = previous
    ts = tensors()
    writer = CheckpointWriter(path, metas(ts))
    with pytest.raises(CheckpointError, match=words) as caught:
        for name in feed:
            writer.write(name, ts.get(name, torch.zeros(1)))
        writer.finish()
    assert caught.value.tensor == culprit
    assert_untouched(path, digest)
    with pytest.raises(CheckpointError, match="the writer is aborted"):
        writer.write("embed.weight", ts["embed.weight"])


@pytest.mark.parametrize(
    ("tensor", "words"),
    [
        (torch.zeros(32, 9), r"\(32, 9\) torch.float32 does not match the header's \(32, 8\)"),
        (torch.zeros(32, 8, dtype=torch.float16), "torch.float16 does not match"),
    ],
)
def test_wrong_shape_or_dtype_is_refused_by_name(previous, tensor, words: str) -> None:
    path, digest = previous
    with (
        pytest.raises(CheckpointError, match=words) as caught,
        CheckpointWriter(path, metas(tensors())) as writer,
    ):
        writer.write("embed.weight", tensor)
    assert caught.value.tensor == "embed.weight"
    assert_untouched(path, digest)


def test_abort_and_exceptions_leave_the_previous_file(previous) -> None:
    path, digest = previous
    ts = tensors()
    writer = CheckpointWriter(path, metas(ts))
    writer.write("embed.weight", ts["embed.weight"])
    writer.abort()
    writer.abort()  # idempotent
    assert_untouched(path, digest)

    with pytest.raises(RuntimeError, match="gather failed"), CheckpointWriter(path, metas(ts)) as w:
        w.write("embed.weight", ts["embed.weight"])
        raise RuntimeError("gather failed")  # what a failed collective looks like to the writer
    assert_untouched(path, digest)

    with pytest.raises(CheckpointError, match="without finish"), CheckpointWriter(path, metas(ts)):
        pass
    assert_untouched(path, digest)


def test_bad_headers_are_refused_before_any_file_exists(tmp_path: Path) -> None:
    meta = torch.empty(2, device="meta")
    for specs, words in [
        ([("a", meta), ("a", meta)], "named twice"),
        ({"a": torch.empty(2, dtype=torch.complex64)}, "has no safetensors name"),
        ({"__metadata__": meta}, "reserved name"),
    ]:
        with pytest.raises(CheckpointError, match=words):
            CheckpointWriter(tmp_path / "c.safetensors", specs)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []
