"""Reading checkpoints: a file or a sharded directory, validated, handed out as zero-copy views.

Reads never unpickle and never trust the file: every header is checked before any tensor is
touched (see :mod:`.header`), a shard index is checked against the shards, and tensors are
views of a private memory map, so a push reads each byte once, from the page cache straight
into the engine's storage.

Limitation: a file that another program truncates *in place* while an engine has it mapped
makes the engine's next read of the lost pages fault (SIGBUS); only rename-into-place writers
(like :func:`~weight_bridge.checkpoint.save_checkpoint`) are safe to run beside a push.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from ..delta.format import Delta, is_delta, read_delta
from ..layout import TensorSpec
from .errors import CheckpointError
from .format import HASH_KEY, INDEX_NAME, MAX_INDEX_BYTES, content_hash
from .header import SafetensorsFile, open_file
from .held import HeldFile


def read_json(file: Path, what: str) -> Any:
    """The JSON document of a small file a checkpoint carries (``what``: a shard index, an
    adapter config), refused by name when it is larger than any such file is or is not JSON."""
    try:
        if file.stat().st_size > MAX_INDEX_BYTES:
            raise CheckpointError(file, f"corrupt {what}: larger than {MAX_INDEX_BYTES}")
        return json.loads(file.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise CheckpointError(file, f"cannot read {what}: {exc.strerror or exc}") from exc
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(file, f"corrupt {what}: {type(exc).__name__}: {exc}") from None


def _read_index(index: Path) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> shard file name) of a shard index, validated."""
    doc = read_json(index, "shard index")
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(index, "corrupt shard index: no weight_map object")
    for tensor, name in weight_map.items():
        if not isinstance(name, str):
            raise CheckpointError(index, f"shard name {name!r} is not a string", tensor)
    return weight_map


def _inside(where: Path, root: Path, name: str) -> Path:
    """``root / name`` resolved, refused unless it is a regular file inside ``root``."""
    if not name or "\x00" in name:
        raise CheckpointError(where, f"invalid shard name {name!r}")
    try:
        resolved = (root / name).resolve(strict=True)
    except FileNotFoundError:
        raise CheckpointError(where, f"shard {name!r} does not exist") from None
    except (OSError, RuntimeError, ValueError) as exc:  # symlink loops, bad names
        raise CheckpointError(where, f"cannot resolve shard {name!r}: {exc}") from None
    if resolved == root or not resolved.is_relative_to(root):
        raise CheckpointError(where, f"shard path {name!r} escapes {root}")
    if not resolved.is_file():
        raise CheckpointError(where, f"shard {name!r} is not a regular file")
    return resolved


def _resolve(checkpoint: str | os.PathLike) -> tuple[list[Path], dict[str, Path] | None]:
    """The files of a checkpoint and, for an indexed directory, tensor name -> its file."""
    path = Path(checkpoint)
    if path.is_file():
        return [path], None
    if not path.exists():
        raise CheckpointError(path, "no such checkpoint file or directory")
    if not path.is_dir():
        raise CheckpointError(path, "not a regular file or a directory")
    root = path.resolve()
    index = path / INDEX_NAME
    if index.is_file():
        weight_map = _read_index(index)
        by_name = {name: _inside(index, root, name) for name in sorted(set(weight_map.values()))}
        if not by_name:
            raise CheckpointError(index, "shard index lists no tensors")
        return list(by_name.values()), {t: by_name[n] for t, n in weight_map.items()}
    files = [_inside(path, root, p.name) for p in sorted(path.glob("*.safetensors"))]
    if not files:
        raise CheckpointError(path, "directory holds no .safetensors file")
    return files, None


def resolve_checkpoint_files(checkpoint: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint: one file, or a directory (index json honoured).

    Paths named by an index, and files found in a directory, must resolve (symlinks followed)
    to regular files inside the checkpoint's directory: ``../x``, absolute paths and symlinks
    that lead out are refused.
    """
    return _resolve(checkpoint)[0]


class CheckpointSource(Protocol):
    """What an update reads: a file (:class:`CheckpointReader`) or tensors in memory
    (:class:`~.live.LiveCheckpoint`). Its name (for messages and the served chain), header
    fields, ``files`` (none in memory: the files a message names), tensors (in memory,
    descriptions its ``stream`` produces) and ``close``. What only a file can do (hold,
    hash, re-read) the update asks of a :class:`CheckpointReader`."""

    files: Any

    @property
    def path(self) -> Any: ...

    @property
    def metadata(self) -> dict[str, str]: ...

    def tensors(self) -> Iterator[tuple[str, Any]]: ...

    def close(self) -> None: ...


class CheckpointReader:
    """A validated, memory-mapped safetensors checkpoint (a file or a sharded directory).

    Opening parses and checks every header (and a shard index against the shards); it reads no
    tensor bytes. :meth:`tensors` yields zero-copy views in file order. Keep the reader alive
    while the views are in use.
    """

    def __init__(
        self,
        checkpoint: str | os.PathLike,
        hold: bool = False,
        held: Sequence[HeldFile] | None = None,
    ):
        """``hold``: hold each file (:class:`~.held.HeldFile`: open, shared-locked, its
        identity recorded) so that it can be re-read exactly as it is now, after
        :meth:`take_held`. ``held``: re-read those files, through their descriptors, each
        checked against its identity first (a file changed since is refused by name)."""
        self.path = Path(checkpoint)
        self.files: list[SafetensorsFile] = []
        self._own = held is None  # whether the held files are this reader's to release
        self.held: list[HeldFile] = list(held or [])
        try:
            if held is not None:
                paths, indexed = [h.path for h in held], None
            else:
                paths, indexed = _resolve(checkpoint)
                if hold:
                    for p in paths:
                        self.held.append(HeldFile(p))
            for i, p in enumerate(paths):
                f = open_file(p, self.held[i].via if self.held else None)
                self.files.append(f)
                if held is not None:
                    self.held[i].check(f.metadata.get(HASH_KEY))
                elif hold:
                    self.held[i].stamped(f.metadata.get(HASH_KEY))
            self._where: dict[str, SafetensorsFile] = {}
            for f in self.files:
                for name in f.entries:
                    if name in self._where:
                        raise CheckpointError(
                            f.path, f"also stored in {self._where[name].path.name}", name
                        )
                    self._where[name] = f
            if indexed is not None:
                self._check_index(indexed)
        except BaseException:
            self.close()
            raise

    def take_held(self) -> list[HeldFile]:
        """The files this reader holds, now the caller's to release (see ``hold``)."""
        held, self.held, self._own = self.held, [], False
        return held

    def _check_index(self, indexed: dict[str, Path]) -> None:
        index = self.path / INDEX_NAME
        for name, file in indexed.items():
            holder = self._where.get(name)
            if holder is None or holder.path != file:
                raise CheckpointError(
                    file, "listed in the shard index for this file but not stored in it", name
                )
        for name, holder in self._where.items():
            if name not in indexed:
                raise CheckpointError(
                    holder.path, f"stored here but not listed in {index.name}", name
                )

    @property
    def metadata(self) -> dict[str, str]:
        return dict(self.files[0].metadata) if self.files else {}

    @property
    def nbytes(self) -> int:
        return sum(e.end - e.begin for f in self.files for e in f.entries.values())

    def specs(self) -> dict[str, TensorSpec]:
        """Name -> shape, dtype of every tensor, from the headers alone."""
        return {
            name: TensorSpec(e.shape, e.dtype) for f in self.files for name, e in f.entries.items()
        }

    def file_of(self, name: str) -> Path | None:
        """The file that stores tensor ``name``, or None."""
        f = self._where.get(name)
        return f.path if f is not None else None

    def _map(self, f: SafetensorsFile) -> mmap.mmap:
        if f.map is None:
            raise CheckpointError(f.path, "reader is closed")
        return f.map

    def tensor(self, name: str) -> torch.Tensor:
        f = self._where.get(name)
        if f is None:
            raise CheckpointError(self.path, "no such tensor", name)
        e = f.entries[name]
        if e.end == e.begin:
            return torch.empty(e.shape, dtype=e.dtype)
        raw = torch.frombuffer(
            self._map(f), dtype=torch.uint8, count=e.end - e.begin, offset=f.data_start + e.begin
        )
        return raw.view(e.dtype).view(e.shape)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor as ``(name, view)``, in the order the bytes lie in the files."""
        for f in self.files:
            for name, _ in sorted(f.entries.items(), key=lambda kv: kv[1].begin):
                yield name, self.tensor(name)

    @property
    def is_delta(self) -> bool:
        """Whether this checkpoint is a delta (:mod:`weight_bridge.delta.format`)."""
        return is_delta(self.metadata)

    def delta(self) -> Delta:
        """The delta this checkpoint holds, decoded and checked (indices sorted, unique and in
        range, every part present, a fingerprint per tensor); a ``CheckpointError`` names the
        tensor otherwise, or says the checkpoint is not a delta."""
        return read_delta(str(self.path), self.metadata, dict(self.tensors()))

    def verify_hash(self) -> None:
        """Recompute the content hash written by :func:`.save_checkpoint`; raise if it differs."""
        for f in self.files:
            want = f.metadata.get(HASH_KEY)
            if want is None:
                raise CheckpointError(f.path, f"no content hash ({HASH_KEY}) in the header")
            got = content_hash(memoryview(self._map(f))[f.data_start :])
            if got != want:
                raise CheckpointError(
                    f.path, "content hash mismatch: the file was changed or torn after it was saved"
                )

    def close(self) -> None:
        # Mappings close when the last view of them is gone (closing one that a tensor still
        # views would raise), so only the reader's references are dropped.
        for f in getattr(self, "files", []):
            f.map = None
        if getattr(self, "_own", False):
            for h in self.held:
                h.release()
            self.held = []

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
