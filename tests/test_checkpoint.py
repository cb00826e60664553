"""Checkpoint files under attack and under failure: real files, real processes, real signals.

Every bad input goes through the same path a worker takes (``CheckpointReader`` then
``direct_reload(model, reader.tensors())`` into a toy module with a recorded layout) and must be
refused before the first byte is written: the model's bytes are compared before and after.
Writes are killed with SIGKILL and starved with RLIMIT_FSIZE / a full tmpfs in subprocesses.
"""

from __future__ import annotations

import ast
import json
import math
import os
import pickle
import signal
import stat
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import Evil
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch import nn

import weight_bridge.checkpoint.write as ckpt_write
from weight_bridge.checkpoint import CheckpointError, CheckpointReader, save_checkpoint
from weight_bridge.checkpoint.format import HASH_KEY, INDEX_NAME
from weight_bridge.checkpoint.read import resolve_checkpoint_files
from weight_bridge.checkpoint.space import STALE_TEMP_AGE_S
from weight_bridge.direct import DirectReloadError, direct_reload, record_checkpoint_layout

ROOT = Path(__file__).resolve().parents[1]
FUZZ = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)


# -- a toy model and its checkpoints -----------------------------------------------------------


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 2, bias=False)
        self.norm = nn.Parameter(torch.ones(2))


NAMES = ["a.weight", "a.bias", "b.weight", "norm"]


def toy_ckpt(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(3, 4, generator=g),
        "a.bias": torch.randn(3, generator=g),
        "b.weight": torch.randn(2, 3, generator=g),
        "norm": torch.rand(2, generator=g) + 0.5,
    }


def toy() -> Toy:
    model = Toy()
    with torch.no_grad():
        for name, t in toy_ckpt(0).items():
            model.get_parameter(name).copy_(t)
    record_checkpoint_layout(model)
    return model


def raw_bytes(model: nn.Module) -> dict[str, bytes]:
    """Exact bytes of every parameter (NaN-safe, unlike ==)."""
    return {
        n: p.detach().contiguous().view(torch.uint8).numpy().tobytes()
        for n, p in model.named_parameters()
    }


def push_file(model: nn.Module, path: Path, verify_hash: bool = False, check_finite: bool = True):
    """What a worker does for a push (``weight_bridge_push``), minus vLLM."""
    with CheckpointReader(path) as reader:
        if verify_hash:
            reader.verify_hash()
        return direct_reload(model, reader.tensors(), check_finite=check_finite)


def header_and_data(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_raw(path: Path, header: object, data: bytes = b"", pad: bool = True) -> Path:
    text = json.dumps(header).encode() if not isinstance(header, bytes) else header
    if pad:
        text += b" " * (-(8 + len(text)) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


# -- bad inputs: each a real file, refused by name before a byte is written --------------------


def _save(tmp: Path, name: str, tensors: dict[str, torch.Tensor]) -> Path:
    save_file(tensors, str(tmp / name))
    return tmp / name


def bad_missing(tmp: Path):
    c = toy_ckpt(1)
    c.pop("a.bias")
    return _save(tmp, "missing.safetensors", c), DirectReloadError, "missing", "a.bias"


def bad_extra(tmp: Path):
    c = toy_ckpt(1) | {"ghost.weight": torch.zeros(2)}
    return _save(tmp, "extra.safetensors", c), DirectReloadError, "unexpected", "ghost.weight"


def bad_shape(tmp: Path):
    c = toy_ckpt(1) | {"b.weight": torch.zeros(3, 2)}
    return _save(tmp, "shape.safetensors", c), DirectReloadError, "shape", "b.weight"


def bad_dtype(tmp: Path):
    c = toy_ckpt(1) | {"a.weight": torch.zeros(3, 4, dtype=torch.int32)}
    return _save(tmp, "dtype.safetensors", c), DirectReloadError, "cannot be converted", "a.weight"


def bad_nan(tmp: Path):
    c = toy_ckpt(1)
    c["norm"][1] = float("nan")
    return _save(tmp, "nan.safetensors", c), DirectReloadError, "1 NaN", "norm"


def bad_inf(tmp: Path):
    c = toy_ckpt(1)
    c["a.bias"][0] = float("-inf")
    return _save(tmp, "inf.safetensors", c), DirectReloadError, "1 Inf", "a.bias"


def bad_other_model(tmp: Path):
    other = {"encoder.weight": torch.randn(4, 4), "encoder.bias": torch.randn(4)}
    return _save(tmp, "other.safetensors", other), DirectReloadError, "unexpected", "encoder.bias"


def bad_truncated(tmp: Path):
    good = _save(tmp, "good.safetensors", toy_ckpt(1))
    raw = good.read_bytes()
    (tmp / "truncated.safetensors").write_bytes(raw[:-5])
    return tmp / "truncated.safetensors", CheckpointError, "truncated", None


def bad_corrupt_header(tmp: Path):
    good = _save(tmp, "good.safetensors", toy_ckpt(1))
    raw = bytearray(good.read_bytes())
    raw[20:24] = b"\xff\x00}]"
    (tmp / "corrupt.safetensors").write_bytes(bytes(raw))
    return tmp / "corrupt.safetensors", CheckpointError, "corrupt header", None


def bad_oversized_header(tmp: Path):
    path = tmp / "oversized.safetensors"
    path.write_bytes(struct.pack("<Q", 2**40) + b"{}" + bytes(64))
    return path, CheckpointError, "header size 1099511627776 exceeds", None


def bad_header_beyond_file(tmp: Path):
    path = tmp / "short.safetensors"
    path.write_bytes(struct.pack("<Q", 4096) + b'{"a":1}')
    return path, CheckpointError, "truncated: header of 4096 bytes", None


def bad_empty(tmp: Path):
    (tmp / "empty.safetensors").write_bytes(b"")
    return tmp / "empty.safetensors", CheckpointError, "empty file", None


def bad_torch_zip(tmp: Path):
    path = tmp / "zip.safetensors"
    torch.save({"w": Evil(tmp / "PWNED"), **toy_ckpt(1)}, path)
    return path, CheckpointError, "zip archive", None


def bad_torch_legacy(tmp: Path):
    path = tmp / "legacy.safetensors"
    torch.save(
        {"w": Evil(tmp / "PWNED"), **toy_ckpt(1)}, path, _use_new_zipfile_serialization=False
    )
    return path, CheckpointError, "pickle", None


def bad_raw_pickle(tmp: Path):
    path = tmp / "raw.safetensors"
    path.write_bytes(pickle.dumps({"w": Evil(tmp / "PWNED")}, protocol=5))
    return path, CheckpointError, "pickle", None


def bad_duplicate_key(tmp: Path):
    text = (
        b'{"norm":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
        b'"norm":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}'
    )
    return write_raw(tmp / "dup.safetensors", text, bytes(16)), CheckpointError, "twice", None


def bad_overlap(tmp: Path):
    header = {
        "a.bias": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]},
        "norm": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    return (
        write_raw(tmp / "overlap.safetensors", header, bytes(12)),
        CheckpointError,
        "overlaps",
        "norm",
    )


def bad_bool_shape(tmp: Path):
    header = {"norm": {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}}
    return (
        write_raw(tmp / "bool.safetensors", header, bytes(8)),
        CheckpointError,
        "invalid shape",
        "norm",
    )


def bad_list_dtype(tmp: Path):
    header = {"norm": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}
    return (
        write_raw(tmp / "ldt.safetensors", header, bytes(8)),
        CheckpointError,
        "unsupported dtype",
        "norm",
    )


def bad_deep_json(tmp: Path):
    text = b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    return write_raw(tmp / "deep.safetensors", text), CheckpointError, "RecursionError", None


def bad_huge_int(tmp: Path):
    text = b'{"norm":{"dtype":"F32","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,8]}}'
    return (
        write_raw(tmp / "digits.safetensors", text, bytes(8)),
        CheckpointError,
        "corrupt header",
        None,
    )


def _sharded(tmp: Path, weight_map: dict[str, str]) -> Path:
    d = tmp / "sharded"
    d.mkdir()
    c = toy_ckpt(1)
    save_file({k: c[k] for k in ("a.weight", "a.bias")}, str(d / "s1.safetensors"))
    save_file({k: c[k] for k in ("b.weight", "norm")}, str(d / "s2.safetensors"))
    (d / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


GOOD_MAP = {"a.weight": "s1.safetensors", "a.bias": "s1.safetensors"} | {
    "b.weight": "s2.safetensors",
    "norm": "s2.safetensors",
}


def bad_index_missing_file(tmp: Path):
    d = _sharded(tmp, GOOD_MAP | {"norm": "s3.safetensors"})
    return d, CheckpointError, "shard 's3.safetensors' does not exist", None


def bad_index_dotdot(tmp: Path):
    _save(tmp, "evil.safetensors", toy_ckpt(1))
    d = _sharded(tmp, GOOD_MAP | {"norm": "../evil.safetensors"})
    return d, CheckpointError, "'../evil.safetensors' escapes", None


def bad_index_absolute(tmp: Path):
    evil = _save(tmp, "evil.safetensors", toy_ckpt(1))
    d = _sharded(tmp, GOOD_MAP | {"norm": str(evil)})
    return d, CheckpointError, "escapes", None


def bad_index_symlink(tmp: Path):
    evil = _save(tmp, "evil.safetensors", toy_ckpt(1))
    d = _sharded(tmp, GOOD_MAP | {"norm": "link.safetensors"})
    (d / "link.safetensors").symlink_to(evil)
    return d, CheckpointError, "'link.safetensors' escapes", None


def bad_glob_symlink(tmp: Path):
    """No index: every *.safetensors in the directory is read; a symlink out is refused too."""
    evil = _save(tmp, "evil.safetensors", {"norm": torch.ones(2)})
    d = tmp / "plain"
    d.mkdir()
    c = toy_ckpt(1)
    save_file({k: v for k, v in c.items() if k != "norm"}, str(d / "main.safetensors"))
    (d / "zz.safetensors").symlink_to(evil)
    return d, CheckpointError, "'zz.safetensors' escapes", None


def bad_index_mismatch(tmp: Path):
    d = _sharded(tmp, GOOD_MAP | {"norm": "s1.safetensors"})
    return d, CheckpointError, "listed in the shard index", "norm"


def bad_index_unlisted(tmp: Path):
    m = dict(GOOD_MAP)
    m.pop("norm")
    return _sharded(tmp, m), CheckpointError, "not listed in", "norm"


def bad_index_json(tmp: Path):
    d = _sharded(tmp, GOOD_MAP)
    (d / INDEX_NAME).write_text('{"weight_map": ["s1.safetensors"]}')
    return d, CheckpointError, "corrupt shard index", None


def bad_shard_twice(tmp: Path):
    d = tmp / "twice"
    d.mkdir()
    c = toy_ckpt(1)
    save_file(c, str(d / "x1.safetensors"))
    save_file({"norm": c["norm"]}, str(d / "x2.safetensors"))
    return d, CheckpointError, "also stored in x1.safetensors", "norm"


def bad_fifo(tmp: Path):
    """A FIFO named like a shard: opening it for reading would block forever."""
    d = tmp / "fifo"
    d.mkdir()
    save_file(toy_ckpt(1), str(d / "a.safetensors"))
    os.mkfifo(d / "b.safetensors")
    return d, CheckpointError, "not a regular file", None


BAD: dict[str, Callable[[Path], tuple]] = {
    f.__name__[4:]: f
    for f in [
        bad_missing,
        bad_extra,
        bad_shape,
        bad_dtype,
        bad_nan,
        bad_inf,
        bad_other_model,
        bad_truncated,
        bad_corrupt_header,
        bad_oversized_header,
        bad_header_beyond_file,
        bad_empty,
        bad_torch_zip,
        bad_torch_legacy,
        bad_raw_pickle,
        bad_duplicate_key,
        bad_overlap,
        bad_bool_shape,
        bad_list_dtype,
        bad_deep_json,
        bad_huge_int,
        bad_index_missing_file,
        bad_index_dotdot,
        bad_index_absolute,
        bad_index_symlink,
        bad_glob_symlink,
        bad_index_mismatch,
        bad_index_unlisted,
        bad_index_json,
        bad_shard_twice,
        bad_fifo,
    ]
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_refused_before_first_byte(case: str, tmp_path: Path) -> None:
    path, error, words, tensor = BAD[case](tmp_path)
    model = toy()
    before = raw_bytes(model)
    with pytest.raises((CheckpointError, DirectReloadError)) as info:
        push_file(model, path)
    exc = info.value
    assert type(exc) is error, f"{case}: {type(exc).__name__}: {exc}"
    assert words in str(exc), str(exc)
    if tensor is not None:
        assert repr(tensor) in str(exc) or f"{tensor}:" in str(exc), str(exc)
    if isinstance(exc, CheckpointError):
        # names the file: the checkpoint itself, one of its shards, or its index
        assert exc.path.startswith(str(path)) or Path(exc.path).parent == path.resolve(), exc.path
        assert str(exc).startswith(exc.path) and exc.problem in str(exc)
    assert raw_bytes(model) == before
    assert not (tmp_path / "PWNED").exists()


def test_the_hostile_pickles_do_execute_when_unpickled(tmp_path: Path) -> None:
    """Control for the cases above: the marker mechanism works, so its absence means something."""
    marker = tmp_path / "PWNED"
    pickle.loads(pickle.dumps(Evil(marker)))
    assert marker.exists()


@pytest.mark.parametrize("case", ["torch_zip", "torch_legacy", "raw_pickle"])
def test_pickles_are_never_unpickled(case: str, tmp_path: Path, monkeypatch) -> None:
    """Tripwires (not fault injection): every unpickling entry point raises if reached."""
    path, *_ = BAD[case](tmp_path)
    calls: list[str] = []

    def tripwire(name: str):
        def hit(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} was called")

        return hit

    monkeypatch.setattr(pickle, "load", tripwire("pickle.load"))
    monkeypatch.setattr(pickle, "loads", tripwire("pickle.loads"))
    monkeypatch.setattr(pickle, "Unpickler", tripwire("pickle.Unpickler"))
    monkeypatch.setattr(torch, "load", tripwire("torch.load"))
    with pytest.raises(CheckpointError, match="never loaded"):
        push_file(toy(), path)
    assert calls == [] and not (tmp_path / "PWNED").exists()


UNPICKLERS = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}


def test_bridge_source_never_loads_pickles() -> None:
    """Grep-proof, on the syntax tree: no pickle module import, no torch.load / np.load call."""
    offences = []
    for file in sorted((ROOT / "weight_bridge").rglob("*.py")):
        tree = ast.parse(file.read_text(), str(file))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [(node.module or "").split(".")[0]]
                if node.module == "torch" and any(a.name == "load" for a in node.names):
                    mods.append("torch.load")
            elif isinstance(node, ast.Attribute) and node.attr in ("load", "loads"):
                base = node.value
                mods = [f"{base.id}.{node.attr}"] if isinstance(base, ast.Name) else []
                mods = [m for m in mods if m.split(".")[0] in {"torch", "np", "numpy"} | UNPICKLERS]
            else:
                continue
            for m in mods:
                if m.split(".")[0] in UNPICKLERS or m in {"torch.load", "np.load", "numpy.load"}:
                    offences.append(f"{file.relative_to(ROOT)}:{node.lineno}: {m}")
    assert offences == []
    text = "\n".join(f.read_text() for f in (ROOT / "weight_bridge").rglob("*.py"))
    assert "torch.load(" not in text and "weights_only=False" not in text


# -- the content hash --------------------------------------------------------------------------


def test_hash_detects_a_flipped_byte_in_the_data(tmp_path: Path) -> None:
    saved = save_checkpoint(toy_ckpt(1), tmp_path / "c.safetensors")
    push_file(toy(), saved.path, verify_hash=True)  # intact: accepted
    raw = bytearray(saved.path.read_bytes())
    raw[-3] ^= 0x01  # one bit of the last tensor's data
    saved.path.write_bytes(bytes(raw))
    model = toy()
    before = raw_bytes(model)
    with pytest.raises(CheckpointError, match="content hash mismatch") as info:
        push_file(model, saved.path, verify_hash=True)
    assert info.value.path == str(saved.path)
    assert raw_bytes(model) == before


def test_hash_detects_swapped_and_torn_files(tmp_path: Path) -> None:
    a = save_checkpoint(toy_ckpt(1), tmp_path / "a.safetensors").path
    b = save_checkpoint(toy_ckpt(2), tmp_path / "b.safetensors").path
    ha, da = header_and_data(a)
    _, db = header_and_data(b)
    assert len(da) == len(db)  # same layout: the headers' offsets match either data
    swapped = write_raw(tmp_path / "swapped.safetensors", ha, db)
    torn = write_raw(tmp_path / "torn.safetensors", ha, da[: len(da) // 2] + db[len(db) // 2 :])
    for path in (swapped, torn):
        with CheckpointReader(path) as reader:  # structurally a fine file...
            assert len(list(reader.tensors())) == len(NAMES)
        with pytest.raises(CheckpointError, match="content hash mismatch"):
            push_file(toy(), path, verify_hash=True)  # ...that the hash refuses


def test_verify_hash_refuses_a_file_without_one(tmp_path: Path) -> None:
    path = _save(tmp_path, "nohash.safetensors", toy_ckpt(1))
    with pytest.raises(CheckpointError, match="no content hash"):
        push_file(toy(), path, verify_hash=True)


def test_nan_guard_can_be_switched_off(tmp_path: Path) -> None:
    path, *_ = bad_nan(tmp_path)
    model = toy()
    push_file(model, path, check_finite=False)
    assert torch.isnan(model.norm).any()


def test_a_good_sharded_checkpoint_loads(tmp_path: Path) -> None:
    d = _sharded(tmp_path, GOOD_MAP)
    model = toy()
    push_file(model, d)
    for name, t in toy_ckpt(1).items():
        assert torch.equal(model.get_parameter(name), t)
    with CheckpointReader(d) as reader:
        assert reader.file_of("norm") == (d / "s2.safetensors").resolve()
    assert resolve_checkpoint_files(d) == [(d / f"s{i}.safetensors").resolve() for i in (1, 2)]


def test_a_symlink_inside_the_directory_is_fine(tmp_path: Path) -> None:
    d = _sharded(tmp_path, GOOD_MAP | {"b.weight": "l2.safetensors", "norm": "l2.safetensors"})
    (d / "l2.safetensors").symlink_to("s2.safetensors")
    push_file(toy(), d)


def test_f8_e4m3_nan_is_refused_by_name(tmp_path: Path) -> None:
    c = {k: v.to(torch.float8_e4m3fn) for k, v in toy_ckpt(1).items()}
    c["norm"].view(torch.uint8)[0] = 0x7F  # NaN in e4m3fn
    path = _save(tmp_path, "f8.safetensors", c)
    model = toy()
    before = raw_bytes(model)
    with pytest.raises(DirectReloadError) as info:
        push_file(model, path)
    assert info.value.problems == {"norm": "holds 1 NaN and 0 Inf values"}, str(info.value)
    assert "norm: holds 1 NaN" in str(info.value)
    assert raw_bytes(model) == before


def test_values_that_overflow_the_model_dtype_are_refused(tmp_path: Path) -> None:
    c = {k: v.double() for k, v in toy_ckpt(1).items()}
    c["norm"][0] = 1e300
    model = toy()
    before = raw_bytes(model)
    with pytest.raises(DirectReloadError) as info:
        push_file(model, _save(tmp_path, "f64.safetensors", c))
    why = "holds values beyond the range of torch.float32 (would become Inf)"
    assert info.value.problems == {"norm": why}, str(info.value)
    assert f"norm: {why}" in str(info.value)
    assert torch.isfinite(model.norm).all() and raw_bytes(model) == before


# -- fuzzing the header and preflight path -----------------------------------------------------


def _check_one(path: Path) -> None:
    """Reader + direct reload: only our two errors, and no partial write when one is raised."""
    model = toy()
    before = raw_bytes(model)
    try:
        with CheckpointReader(path) as reader:
            items = list(reader.tensors())
            direct_reload(model, items)
    except (CheckpointError, DirectReloadError) as exc:
        assert raw_bytes(model) == before
        event(f"refused: {type(exc).__name__}")
        return
    event("accepted")
    for name, t in items:  # accepted: the model holds exactly the checkpoint
        assert torch.equal(model.get_parameter(name), t.to(torch.float32))


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@pytest.mark.timeout(300)
@FUZZ
@given(data=st.binary(max_size=600))
def test_fuzz_random_bytes(fuzz_dir: Path, data: bytes) -> None:
    path = fuzz_dir / "random.safetensors"
    path.write_bytes(data)
    _check_one(path)


@pytest.mark.timeout(300)
@FUZZ
@given(body=st.binary(max_size=400), delta=st.integers(-16, 16), brace=st.booleans())
def test_fuzz_random_header_bytes(fuzz_dir: Path, body: bytes, delta: int, brace: bool) -> None:
    """A plausible length prefix, so random header bytes reach the JSON parser."""
    if brace:
        body = b"{" + body
    path = fuzz_dir / "rheader.safetensors"
    path.write_bytes(struct.pack("<Q", max(0, len(body) + delta)) + body)
    _check_one(path)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
DTYPE_NAMES = [
    "F32",
    "F16",
    "BF16",
    "F64",
    "I32",
    "I64",
    "U8",
    "BOOL",
    "F8_E5M2",
    "F8_E4M3",
]
GOOD_SHAPES = {"a.weight": [3, 4], "a.bias": [3], "b.weight": [2, 3], "norm": [2]}


FIELDS = {
    "dtype": st.sampled_from(DTYPE_NAMES) | JSON,
    "shape": st.lists(st.integers(-2, 5) | st.sampled_from([True, 2**64, 1.5]), max_size=3) | JSON,
    "data_offsets": st.lists(st.integers(-4, 120), max_size=3) | JSON,
}


@st.composite
def headers(draw) -> tuple[dict, bytes]:
    """The toy's true header (data random bytes, so NaN sometimes), then 0 to 3 mutations:
    a wrong dtype, shape or offsets, a dropped or extra entry, an entry that is not an object,
    or stray metadata."""
    header: dict = {}
    offset = 0
    for name in draw(st.permutations(NAMES)):
        size = math.prod(GOOD_SHAPES[name]) * 4
        header[name] = {
            "dtype": "F32",
            "shape": GOOD_SHAPES[name],
            "data_offsets": [offset, offset + size],
        }
        offset += size
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["field", "field", "drop", "extra", "entry", "metadata"]))
        name = draw(st.sampled_from(sorted(header)))
        if kind == "field":
            field = draw(st.sampled_from(sorted(FIELDS)))
            entry = header[name] if isinstance(header[name], dict) else {}
            header[name] = entry | {field: draw(FIELDS[field])}
        elif kind == "drop":
            header.pop(name)
        elif kind == "extra":
            header[draw(st.text(max_size=4))] = {k: draw(v) for k, v in FIELDS.items()}
        elif kind == "entry":
            header[name] = draw(JSON)
        else:
            header["__metadata__"] = draw(
                st.dictionaries(st.text(max_size=4), st.text(max_size=4)) | JSON
            )
        if not header:
            break
    data = draw(st.binary(min_size=max(0, offset - 8), max_size=offset + 8))
    return header, data


@pytest.mark.timeout(300)
@FUZZ
@given(case=headers(), pad=st.booleans())
def test_fuzz_json_headers(fuzz_dir: Path, case: tuple[dict, bytes], pad: bool) -> None:
    header, data = case
    path = write_raw(fuzz_dir / "jheader.safetensors", header, data, pad=pad)
    _check_one(path)


@pytest.mark.timeout(120)
def test_every_truncation_is_refused(tmp_path: Path) -> None:
    full = save_checkpoint(toy_ckpt(1), tmp_path / "full.safetensors").path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    model = toy()
    before = raw_bytes(model)
    for n in range(len(full)):
        cut.write_bytes(full[:n])
        with pytest.raises(CheckpointError):
            push_file(model, cut)
    assert raw_bytes(model) == before


@pytest.mark.timeout(300)
@FUZZ
@given(pos=st.integers(0, 10_000), value=st.integers(0, 255))
def test_fuzz_one_corrupted_header_byte(fuzz_dir: Path, pos: int, value: int) -> None:
    src = fuzz_dir / "src.safetensors"
    if not src.exists():
        save_checkpoint(toy_ckpt(1), src)
    raw = bytearray(src.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    raw[pos % (8 + n)] = value
    path = fuzz_dir / "flipped.safetensors"
    path.write_bytes(bytes(raw))
    _check_one(path)


# -- writes: owner-only, atomic, killed, starved -----------------------------------------------


@pytest.mark.parametrize("umask", [0o000, 0o022])
def test_checkpoint_is_owner_only_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    path = tmp_path / "c.safetensors"
    path.write_bytes(b"old")
    path.chmod(0o644)  # a world-readable file at the path is replaced, not reused
    old = os.umask(umask)
    try:
        save_checkpoint(toy_ckpt(1), path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_temp_file_is_owner_only_before_any_data(tmp_path: Path, monkeypatch) -> None:
    """A spy on the write helper (it observes, injects nothing): at the first write the temp
    file exists, is empty, and is already 0600, even under umask 0."""
    seen: list[tuple[str, int, int]] = []
    real = ckpt_write._write_all

    def spy(f, data) -> None:
        st_ = os.fstat(f.fileno())
        seen.append(
            (os.readlink(f"/proc/self/fd/{f.fileno()}"), stat.S_IMODE(st_.st_mode), st_.st_size)
        )
        real(f, data)

    monkeypatch.setattr(ckpt_write, "_write_all", spy)
    old = os.umask(0)
    try:
        save_checkpoint(toy_ckpt(1), tmp_path / "c.safetensors")
    finally:
        os.umask(old)
    name, mode, size = seen[0]
    assert Path(name).name.startswith(".c.safetensors.") and name.endswith(".tmp")
    assert mode == 0o600 and size == 0


WRITER = textwrap.dedent(
    """
    import sys, torch
    from weight_bridge.checkpoint import save_checkpoint
    g = torch.Generator().manual_seed(int(sys.argv[2]))
    tensors = {f"t{i}": torch.randn(256, 1024, generator=g) for i in range(int(sys.argv[3]))}
    print("ready", flush=True)
    step = 0
    while True:
        save_checkpoint(tensors, sys.argv[1], metadata={"step": str(step)})
        step += 1
    """
)


def _temps(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.timeout(300)
def test_sigkill_mid_write_leaves_previous_checkpoint_intact(tmp_path: Path) -> None:
    path = tmp_path / "policy.safetensors"
    n_tensors = 48  # 48 MiB: the kill lands while the temporary file grows
    ref = {f"t{i}": t for i, t in enumerate(_writer_tensors(n_tensors))}
    save_checkpoint(ref, path, metadata={"step": "parent"})
    full = path.stat().st_size
    kills = []
    for round_ in range(3):
        child = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path), "0", str(n_tensors)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 120
        partial = None
        while partial is None and time.monotonic() < deadline:
            for tmp in _temps(tmp_path):
                try:
                    with_size = tmp.stat().st_size
                except FileNotFoundError:  # renamed into place meanwhile
                    continue
                if 0 < with_size < full:
                    partial = (tmp, with_size)
                    os.kill(child.pid, signal.SIGKILL)
                    break
        if partial is None:  # the timeout's kill is no kill mid-write: fail, do not count it
            child.kill()
            child.wait(timeout=30)
            pytest.fail(f"round {round_}: no partial temporary file seen in 120 s")
        child.wait(timeout=30)
        assert child.returncode == -signal.SIGKILL, f"round {round_}: {child.returncode}"
        # the kill landed mid-write: the temporary file it caught growing was never renamed
        assert partial[0].exists(), f"round {round_}: {partial[0].name} renamed before the kill"
        kills.append(partial)
        # the file under the final name is a complete checkpoint whose hash verifies
        with CheckpointReader(path) as reader:
            reader.verify_hash()
            assert {n: t.clone() for n, t in reader.tensors()}.keys() == ref.keys()
            assert all(torch.equal(reader.tensor(n), t) for n, t in ref.items())
        assert path.stat().st_size == full
        assert resolve_checkpoint_files(tmp_path) == [path]  # the leftover is never picked up
    assert len(kills) == 3 and all(0 < size < full for _, size in kills), kills
    leftovers = _temps(tmp_path)
    assert {tmp for tmp, _ in kills} <= set(leftovers), (kills, leftovers)
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in leftovers)
    assert all(p.stat().st_size <= full for p in leftovers), kills
    # a later save removes a dead writer's leftovers once they are old enough
    past = time.time() - 2 * STALE_TEMP_AGE_S
    for p in leftovers:
        os.utime(p, (past, past))
    save_checkpoint(ref, path)
    assert _temps(tmp_path) == []


def _writer_tensors(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(256, 1024, generator=g) for _ in range(n)]


def test_stale_temp_cleanup_spares_live_writers_and_other_files(tmp_path: Path) -> None:
    import fcntl

    path = tmp_path / "c.safetensors"
    live = tmp_path / ".other.safetensors.abc12345.tmp"
    live.write_bytes(b"partial")
    unrelated = tmp_path / ".notes.txt.abc12345.tmp"  # not a checkpoint's: never touched
    unrelated.write_bytes(b"x")
    past = time.time() - 2 * STALE_TEMP_AGE_S
    for p in (live, unrelated):
        os.utime(p, (past, past))
    with open(live, "rb") as held:  # a writer at work holds the lock (another open file)
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        save_checkpoint(toy_ckpt(1), path)
        assert live.exists()
    save_checkpoint(toy_ckpt(1), path)  # lock gone: its writer is dead
    assert not live.exists()
    assert unrelated.exists()


FSIZE_CHILD = textwrap.dedent(
    """
    import json, resource, signal, sys, torch
    from weight_bridge.checkpoint import save_checkpoint
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG from write() instead of dying
    limit = int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    big = {f"t{i}": torch.ones(1024, 1024) for i in range(8)}
    try:
        save_checkpoint(big, sys.argv[1])
        print(json.dumps({"error": None}))
    except Exception as exc:
        print(json.dumps({"error": type(exc).__name__, "errno": getattr(exc, "errno", None),
                          "message": str(exc), "is_oserror": isinstance(exc, OSError)}))
    """
)


@pytest.mark.timeout(120)
def test_file_size_limit_during_save(tmp_path: Path) -> None:
    """RLIMIT_FSIZE in a child process: the kernel refuses the write past the limit (EFBIG)."""
    path = tmp_path / "policy.safetensors"
    previous = save_checkpoint(toy_ckpt(1), path)
    proc = subprocess.run(
        [sys.executable, "-c", FSIZE_CHILD, str(path), str(3 * 1024 * 1024)],
        capture_output=True,
        text=True,
        timeout=100,
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["error"] == "CheckpointWriteError" and result["is_oserror"], proc.stderr
    assert result["errno"] == 27  # EFBIG
    assert str(path) in result["message"] and "untouched" in result["message"]
    assert "File too large" in result["message"]
    with CheckpointReader(path) as reader:
        reader.verify_hash()
        assert reader.metadata[HASH_KEY] == previous.hash
    assert _temps(tmp_path) == []


TMPFS_CHILD = textwrap.dedent(
    """
    import json, os, subprocess, sys, torch
    from weight_bridge.checkpoint import CheckpointReader, save_checkpoint
    mnt = sys.argv[1]
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", mnt], check=True)
    path = os.path.join(mnt, "policy.safetensors")
    previous = save_checkpoint({"w": torch.ones(256, 256)}, path)
    out = {}
    try:
        save_checkpoint({f"t{i}": torch.ones(1024, 1024) for i in range(2)}, path)
        out["error"] = None
    except Exception as exc:
        out.update(error=type(exc).__name__, errno=getattr(exc, "errno", None), message=str(exc))
    with CheckpointReader(path) as reader:
        reader.verify_hash()
        out["previous_intact"] = reader.metadata["weight_bridge.blake3"] == previous.hash
    out["files"] = sorted(os.listdir(mnt))
    print(json.dumps(out))
    """
)


@pytest.mark.timeout(120)
@pytest.mark.must_run_in_ci  # CI runs as root: unshare works there
def test_disk_full_during_save(tmp_path: Path) -> None:
    """A real full filesystem: a 4 MiB tmpfs, mounted in a private user+mount namespace."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a mount namespace here: {probe.stderr.decode()[-200:]}")
    proc = subprocess.run(
        ["unshare", "-rm", sys.executable, "-c", TMPFS_CHILD, str(mnt)],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["error"] == "CheckpointWriteError" and out["errno"] == 28, out  # ENOSPC
    assert "No space left on device" in out["message"] and "untouched" in out["message"]
    assert out["previous_intact"] and out["files"] == ["policy.safetensors"]
