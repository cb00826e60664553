"""Opening one safetensors file: its header parsed and checked, its bytes mapped, none read.

The header is checked (size bounds, dtypes, shapes against byte ranges, ranges inside the
file, no duplicate names) before any tensor is touched. The file is opened once: its header is
read from, and its map made of, the same open file, so a file renamed over the path in between
cannot pair one file's header with another's bytes. A file that is not safetensors (a
``torch.save`` zip or pickle renamed, say) is refused by its first bytes.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import stat
import struct
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from .errors import CheckpointError
from .format import DTYPES, FOREIGN_MAGIC, MAX_HEADER_BYTES


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor of a header: its dtype, shape and byte range in the data section."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass
class SafetensorsFile:
    """An opened file: its header's content and, until the reader closes, its private map."""

    path: Path
    size: int
    data_start: int
    metadata: dict[str, str]
    entries: dict[str, HeaderEntry]
    map: mmap.mmap | None = None


def _no_duplicates(pairs: list[tuple[str, object]], duplicates: list[str]) -> dict[str, object]:
    """One JSON object of a header: each key seen again goes to ``duplicates`` (refused after
    the parse; a plain ``dict`` would keep the last value silently)."""
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            duplicates.append(key)
        out[key] = value
    return out


def _is_int(x: object) -> bool:
    return type(x) is int  # not bool, which JSON true/false would give


def _pread_all(fd: int, n: int, offset: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = os.pread(fd, n - got, offset + got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _sniff(path: Path, head: bytes) -> None:
    for magic, what in FOREIGN_MAGIC:
        if head.startswith(magic):
            raise CheckpointError(
                path, f"not a safetensors file: it is {what}; pickled formats are never loaded"
            )


def open_file(path: Path, via: Path | None = None) -> SafetensorsFile:
    """Open, validate and map one safetensors file; nothing but the header is read.
    ``via``: another name of the same file to open (a held descriptor's), ``path`` is named."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused just below).
        fd = os.open(via or path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise CheckpointError(path, f"cannot open: {exc.strerror or exc}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(path, "not a regular file")
        size = st.st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            what = "an empty file" if size == 0 else f"{size} bytes is too short"
            raise CheckpointError(path, f"not a safetensors file: {what}")
        (n,) = struct.unpack("<Q", head)
        raw = b""
        if n > MAX_HEADER_BYTES:
            problem = f"not a safetensors file: header size {n} exceeds {MAX_HEADER_BYTES}"
        elif 8 + n > size:
            problem = f"truncated: header of {n} bytes but file has {size - 8} after its length"
        else:
            raw = _pread_all(fd, n, 8)
            problem = "" if raw.startswith(b"{") else "corrupt header: does not start with '{'"
            if len(raw) != n:
                problem = "truncated while being read (file changed)"
        if problem:
            _sniff(path, head)  # a known foreign format is refused by name
            raise CheckpointError(path, problem)
        f = parse_header(path, raw, size)
        try:
            m = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as exc:
            raise CheckpointError(path, f"cannot map: {exc}") from exc
        if len(m) != size:
            m.close()
            raise CheckpointError(path, "file changed size while being opened")
        # ACCESS_COPY: a private mapping, writable from Python's side, so torch can wrap it
        # without a read-only warning; nothing is ever written back to the file.
        f.map = m
        return f
    except OSError as exc:
        raise CheckpointError(path, f"cannot read: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)


def parse_header(path: Path, raw: bytes, size: int) -> SafetensorsFile:
    """Check a header (the JSON after the 8-byte length) against a file of ``size`` bytes."""
    if not raw.startswith(b"{"):
        raise CheckpointError(path, "corrupt header: does not start with '{'")
    duplicates: list[str] = []
    hook = partial(_no_duplicates, duplicates=duplicates)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=hook)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # ValueError covers JSONDecodeError and integers too long to convert.
        raise CheckpointError(path, f"corrupt header: {type(exc).__name__}: {exc}") from None
    if duplicates:
        raise CheckpointError(path, f"corrupt header: key {duplicates[0]!r} appears twice")
    if not isinstance(header, dict):
        raise CheckpointError(path, "corrupt header: not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(path, "corrupt header: __metadata__ must map strings to strings")
    data_start = 8 + len(raw)
    data_size = size - data_start
    entries: dict[str, HeaderEntry] = {}
    for name, info in header.items():
        entries[name] = _parse_entry(path, name, info, data_size)
    spans = sorted((e.begin, e.end, name) for name, e in entries.items() if e.end > e.begin)
    for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:], strict=False):
        if b1 < e0:
            raise CheckpointError(path, f"byte range overlaps tensor {n0!r}", n1)
    return SafetensorsFile(path, size, data_start, metadata, entries)


def _parse_entry(path: Path, name: str, info: object, data_size: int) -> HeaderEntry:
    if not isinstance(info, dict):
        raise CheckpointError(path, "corrupt header entry: not a JSON object", name)
    dtype_name = info.get("dtype")
    dtype = DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise CheckpointError(path, f"unsupported dtype {dtype_name!r}", name)
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
        raise CheckpointError(path, f"invalid shape {shape!r}", name)
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) and o >= 0 for o in offsets)
        or offsets[1] < offsets[0]
    ):
        raise CheckpointError(path, f"invalid data_offsets {offsets!r}", name)
    begin, end = offsets
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise CheckpointError(
            path, f"byte range of {end - begin} bytes does not fit shape {shape} {dtype}", name
        )
    if end > data_size:
        raise CheckpointError(
            path, f"truncated: data ends at byte {end} but the file holds {data_size}", name
        )
    return HeaderEntry(dtype, tuple(shape), begin, end)
