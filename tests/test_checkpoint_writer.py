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
    HASH_KEY,
    CheckpointError,
    CheckpointReader,
    CheckpointWriter,
    save_checkpoint,
)


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


def test_save_checkpoint_writes_the_same_bytes_as_the_stream(tmp_path: Path) -> None:
    """One write path: the mapping wrapper and the stream make byte-identical files."""
    ts = tensors()
    save_checkpoint(ts, tmp_path / "a.safetensors", {"k": "v"})
    with CheckpointWriter(tmp_path / "b.safetensors", metas(ts), {"k": "v"}) as writer:
        for name, t in ts.items():
            writer.write(name, t)
        writer.finish()
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


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
