"""Delta checkpoints: what changed since a base version, as a safetensors file like any other.

A delta is what a sync sends when few values changed (at RL learning rates most bf16 values do
not move from one step to the next). Its metadata says it is a delta (:data:`DELTA_KEY`), names
its base version (:data:`~weight_bridge.checkpoint.format.BASE_VERSION_KEY`: it applies on
exactly that version, never another) and its own (``version``), and records for every tensor it
touches the bit-exact fingerprint (:mod:`weight_bridge.exact`) of the **full** tensor it
produces (:data:`FINGERPRINTS_KEY`, JSON ``{name: 16 hex digits}``).

Each tensor is stored whichever way is smaller:

* **dense**: under its own name, whole, like a partial checkpoint's tensor;
* **sparse**: three tensors, ``NAME@delta.blocks`` (int32, one count per block of 65536
  elements: how many changed there), ``NAME@delta.offsets`` (the changed elements' positions
  inside their block, the low 16 bits of each sorted flat index, stored as int16 bit
  patterns) and ``NAME@delta.values`` (the new values, in the engine's dtype), with the full
  shape in :data:`SHAPES_KEY`. The flat index of the k-th value is ``block * 65536 + offset``,
  so an index costs 2 bytes, not 8: a changed bf16 element costs 4 bytes in all, and a delta
  is smaller than the dense tensor while under half the elements changed.

:func:`read_delta` decodes and checks one (indices strictly increasing, so sorted and without
duplicates, and in range; counts that add up; every part present; a fingerprint for every
tensor), refusing a malformed or truncated delta by tensor name. :func:`encode_sparse` is the
writer's half.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..checkpoint.errors import CheckpointError
from ..checkpoint.format import BASE_VERSION_KEY, VERSION_KEY
from ..exact import bits_of, format_fingerprint

DELTA_KEY = "weight_bridge.delta"  # "1": the format below
FINGERPRINTS_KEY = "weight_bridge.fingerprints"
#: In a checkpoint applied on top of another (a delta, a partial keyframe): the lineage
#: (:func:`lineage_of`) of the weights it was written against, which the engine must serve.
BASE_LINEAGE_KEY = "weight_bridge.base_lineage"
SHAPES_KEY = "weight_bridge.sparse_shapes"
BLOCK = 1 << 16
_PARTS = ("blocks", "offsets", "values")
_SEP = "@delta."


def part_name(name: str, part: str) -> str:
    return f"{name}{_SEP}{part}"


def split_name(key: str) -> tuple[str, str]:
    """A stored tensor's name -> (the tensor it belongs to, its sparse part or "")."""
    name, sep, part = key.partition(_SEP)
    return (name, part) if sep else (key, "")


def is_delta(metadata: Mapping[str, str]) -> bool:
    return metadata.get(DELTA_KEY) is not None


@dataclass(frozen=True)
class SparseTensor:
    """The changed elements of one tensor: sorted flat ``indices`` (int64) and their ``values``."""

    shape: tuple[int, ...]
    indices: torch.Tensor
    values: torch.Tensor

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Delta:
    """A decoded delta: its base and own version, dense and sparse tensors, and fingerprints."""

    base: str
    version: str | None
    dense: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    sparse: dict[str, SparseTensor] = field(default_factory=dict)
    fingerprints: dict[str, int] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.dense] + list(self.sparse)

    @property
    def changed(self) -> int:
        """Elements written: every element of a dense tensor, the listed ones of a sparse one."""
        return sum(t.numel() for _, t in self.dense) + sum(
            s.indices.numel() for s in self.sparse.values()
        )


def sparse_bytes(numel: int, changed: int, itemsize: int) -> int:
    """The bytes a sparse tensor takes in a delta (to choose sparse or dense)."""
    return 4 * -(-numel // BLOCK) + changed * (2 + itemsize)


def changed_indices(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Sorted flat indices (int64) where ``new``'s bits differ from ``old``'s (same shape and
    dtype): bit patterns, so -0.0 and +0.0 differ and a NaN equals itself."""
    return torch.nonzero(bits_of(old.reshape(-1)) != bits_of(new.reshape(-1))).reshape(-1)


def stored_parts(name: str, new: torch.Tensor, changed: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors a delta stores for ``name``: its parts (sparse) or itself (dense),
    whichever is smaller."""
    flat = new.reshape(-1)
    if sparse_bytes(flat.numel(), changed.numel(), flat.element_size()) >= new.nbytes:
        return {name: new}
    parts = encode_sparse(changed, flat[changed], flat.numel())
    return {part_name(name, part): t for part, t in parts.items()}


def lineage_of(base: str | None, fingerprints: Mapping[str, int]) -> str:
    """The identity of the weights a fingerprinted checkpoint leaves served, by content: a
    complete one's (``base`` None) is a digest of every tensor's fingerprint; one applied on
    top of weights of lineage ``base`` (a delta, a partial keyframe), a digest of ``base`` and
    the fingerprints of the tensors it changed. Both ends compute it from the same header, so
    the engine knows what it serves without trusting a label: two trainers that stamp the same
    version on other weights (or byte-identical node-local copies of one trainer's files, which
    must agree) are told apart (or not) by what they wrote."""
    lines = [base or ""] + [f"{n}={format_fingerprint(v)}" for n, v in sorted(fingerprints.items())]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:32]


def delta_metadata(
    base: str, version: str | None, fingerprints: Mapping[str, int], shapes: Mapping[str, list[int]]
) -> dict[str, str]:
    """A delta's header metadata; ``shapes``: the full shape of each sparse tensor. ``version``
    None: none in the file (the engine labels it by the file's name, as any checkpoint)."""
    return {
        DELTA_KEY: "1",
        BASE_VERSION_KEY: str(base),
        **({VERSION_KEY: str(version)} if version is not None else {}),
        FINGERPRINTS_KEY: json.dumps({n: format_fingerprint(v) for n, v in fingerprints.items()}),
        SHAPES_KEY: json.dumps({n: list(s) for n, s in shapes.items()}),
    }


def encode_sparse(
    indices: torch.Tensor, values: torch.Tensor, numel: int
) -> dict[str, torch.Tensor]:
    """The three stored parts of a sparse tensor, from sorted unique flat ``indices``."""
    indices = indices.to(torch.int64)
    blocks = torch.bincount(indices >> 16, minlength=-(-numel // BLOCK)).to(torch.int32)
    offsets = (indices & (BLOCK - 1)).to(torch.int32).to(torch.int16)  # wraps: a bit pattern
    return {"blocks": blocks, "offsets": offsets, "values": values.contiguous()}


def decode_indices(blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Sorted flat indices (int64) from the stored blocks and offsets (counts not checked)."""
    starts = torch.arange(0, blocks.numel() * BLOCK, BLOCK, dtype=torch.int64)
    flat = torch.repeat_interleave(starts, blocks.to(torch.int64))  # each index's block start
    return flat.add_(offsets.to(torch.int32).bitwise_and_(BLOCK - 1))  # its low 16 bits


def _json(path: str, metadata: Mapping[str, str], key: str, what: str = "corrupt delta") -> dict:
    try:
        value = json.loads(metadata.get(key, "{}"))
    except ValueError as exc:
        raise CheckpointError(path, f"{what}: {key} is not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise CheckpointError(path, f"{what}: {key} is not a JSON object")
    return value


def header_fingerprints(path: str, metadata: Mapping[str, str]) -> dict[str, int]:
    """The fingerprints a checkpoint's header records (:data:`FINGERPRINTS_KEY`: name -> 16 hex
    digits; none: empty), every one parsed and checked, so nothing is parsed after the first
    write: a value that is not one (another tool's digest under the key) raises
    :class:`CheckpointError` naming its tensor."""
    recorded = _json(path, metadata, FINGERPRINTS_KEY, "malformed header")
    parsed = {}
    for name, value in recorded.items():
        try:
            if not isinstance(value, str) or len(value) != 16:
                raise ValueError
            parsed[name] = int(value, 16)
        except ValueError:
            raise CheckpointError(
                path, f"malformed header: fingerprint {value!r} is not 16 hex digits", name
            ) from None
    return parsed


def read_delta(
    path: str, metadata: Mapping[str, str], tensors: Mapping[str, torch.Tensor]
) -> Delta:
    """Decode and check a delta from its header's ``metadata`` and its ``tensors`` (views);
    any problem raises :class:`CheckpointError` naming the tensor."""
    if metadata.get(DELTA_KEY) != "1":
        found = metadata.get(DELTA_KEY)
        raise CheckpointError(path, f"not a delta of a known format ({DELTA_KEY}={found!r})")
    base = metadata.get(BASE_VERSION_KEY)
    if base is None:
        raise CheckpointError(path, f"corrupt delta: no {BASE_VERSION_KEY} in its metadata")
    prints = header_fingerprints(path, metadata)
    shapes = _json(path, metadata, SHAPES_KEY)
    delta = Delta(base, metadata.get(VERSION_KEY))
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        name, part = split_name(key)
        if not part:
            delta.dense.append((key, t))
        elif part not in _PARTS:
            raise CheckpointError(path, f"corrupt delta: unknown part {part!r}", name)
        else:
            parts.setdefault(name, {})[part] = t
    for name, stored in parts.items():
        delta.sparse[name] = _sparse(path, name, stored, shapes.get(name))
    for name in shapes:
        if name not in parts:
            raise CheckpointError(path, "truncated delta: its sparse parts are missing", name)
    for name in delta.names:
        if name not in prints:
            raise CheckpointError(path, "corrupt delta: no fingerprint of the full tensor", name)
        delta.fingerprints[name] = prints[name]
    if len({n for n in delta.names}) != len(delta.names):
        dup = next(n for n in delta.names if delta.names.count(n) > 1)
        raise CheckpointError(path, "corrupt delta: stored both dense and sparse", dup)
    return delta


def _sparse(path: str, name: str, found: dict[str, torch.Tensor], shape: object) -> SparseTensor:
    missing = [p for p in _PARTS if p not in found]
    if missing:
        raise CheckpointError(path, f"truncated delta: part(s) {missing} missing", name)
    if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
        raise CheckpointError(path, f"corrupt delta: shape {shape!r}", name)
    numel = math.prod(shape)
    blocks, offsets, values = found["blocks"], found["offsets"], found["values"]
    if blocks.dtype != torch.int32 or offsets.dtype != torch.int16:
        raise CheckpointError(path, "corrupt delta: blocks must be int32, offsets int16", name)
    if blocks.dim() != 1 or offsets.dim() != 1 or values.dim() != 1:
        raise CheckpointError(path, "corrupt delta: parts must be one-dimensional", name)
    if blocks.numel() != -(-numel // BLOCK):
        raise CheckpointError(
            path, f"corrupt delta: {blocks.numel()} block counts for {numel} elements", name
        )
    if bool((blocks < 0).any()) or int(blocks.sum(dtype=torch.int64)) != offsets.numel():
        raise CheckpointError(
            path, "corrupt delta: block counts do not add up to the number of indices", name
        )
    if values.numel() != offsets.numel():
        raise CheckpointError(
            path, f"truncated delta: {values.numel()} values for {offsets.numel()} indices", name
        )
    indices = decode_indices(blocks, offsets)
    if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
        raise CheckpointError(
            path, "corrupt delta: indices not strictly increasing (unsorted or duplicate)", name
        )
    if indices.numel() and int(indices[-1]) >= numel:
        raise CheckpointError(
            path, f"corrupt delta: index {int(indices[-1])} out of range for {numel} elements", name
        )
    return SparseTensor(tuple(shape), indices, values)
