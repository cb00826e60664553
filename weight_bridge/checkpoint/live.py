"""A checkpoint made of tensors this process holds: what an engine inside the trainer's own
process (vLLM's external launcher, no engine-core process) is pushed from.

Why: when vLLM runs in the trainer's ranks, its workers share the trainer's memory, so writing
a file and mapping it back is two memory passes the push does not need. The trainer publishes
its tensors (the live parameters, no copy) under a name; the push names it like a path
(``live:<n>``), so every step of an update (validate the whole checkpoint, plan, write, read
back, the label, the rollback) stays the one the file path takes; the worker opens the name
here instead of a file. A name is only meaningful in the process that published it, and only
while the publishing ``with`` block runs (the push): nothing outlives it, so the tensors are
never held past their step.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import CheckpointError
from .write import SavedCheckpoint

__all__ = ["LIVE_PREFIX", "LiveCheckpoint", "LiveSink", "is_live", "open_live", "published"]

LIVE_PREFIX = "live:"
_published: dict[str, LiveCheckpoint] = {}
_numbers = itertools.count(1)
_lock = threading.Lock()


def is_live(checkpoint: object) -> bool:
    """Whether ``checkpoint`` (a string or a path) names published tensors, not a file."""
    if not isinstance(checkpoint, (str, os.PathLike)):
        return False
    return str(os.fspath(checkpoint)).startswith(LIVE_PREFIX)


@dataclass
class LiveCheckpoint:
    """Tensors published in this process, read like a :class:`~.read.CheckpointReader` (the
    same ``metadata``, ``tensors()`` and ``close()``, what an update's worker reads); it holds
    no file, so there is nothing to hold, hash or re-read (``files`` is empty: a rollback needs
    the pre-images the writer kept)."""

    path: str
    items: list[tuple[str, torch.Tensor]]
    metadata: dict[str, str]

    files = ()  # no shard files: PushFailure names no file

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.items

    def file_of(self, name: str) -> Path | None:
        return None

    def take_held(self) -> list:
        return []

    def verify_hash(self) -> None:
        """Nothing travelled through a file: there is no content hash to check."""

    def close(self) -> None:
        """The tensors are the publisher's: nothing to release."""

    def check_on(self, device: torch.device) -> None:
        """Every tensor materialised on ``device`` (where the engine holds its weights): one on
        the meta device (never materialised) or on another device is refused by name, before
        anything is written (the finiteness check, the write and the read-back all read it)."""
        for name, tensor in self.items:
            if tensor.is_meta:
                raise CheckpointError(
                    self.path, "is on the meta device: it holds no values (not materialised)", name
                )
            here = tensor.device
            if here.type != device.type or (here.index or 0) != (device.index or 0):
                raise CheckpointError(
                    self.path, f"is on {here}, the engine holds its weights on {device}", name
                )


@contextlib.contextmanager
def published(
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    metadata: Mapping[str, str] | None = None,
) -> Iterator[str]:
    """Publish ``tensors`` (not copied) for the block: yields the name a push gives as its
    checkpoint; it is gone when the block ends."""
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    with _lock:
        name = f"{LIVE_PREFIX}{next(_numbers)}"
        _published[name] = LiveCheckpoint(name, items, dict(metadata or {}))
    try:
        yield name
    finally:
        with _lock:
            _published.pop(name, None)


def open_live(name: str | os.PathLike) -> LiveCheckpoint:
    """The tensors published as ``name`` in this process; a name that is not (another
    process's, or one whose push ended) is refused by name."""
    name = str(os.fspath(name))
    with _lock:
        live = _published.get(name)
    if live is None:
        raise CheckpointError(
            name,
            "no tensors are published under this name in the engine's process (live pushes "
            "work only into an engine inside the trainer's process, during the push)",
        )
    return live


class LiveSink:
    """Where a sync's tensors go when they are pushed from memory: a
    :class:`~.delta_sink.Sink` that keeps each tensor in the checkpoint's dtype instead of
    writing it (a cast only where the dtypes differ; else the trainer's own tensor, not
    copied) and, when finished, :func:`published` until ``keep`` closes."""

    def __init__(
        self,
        keep: contextlib.ExitStack,
        path: os.PathLike | str,
        header: list[tuple[str, torch.Tensor]],
        metadata: Mapping,
    ) -> None:
        self.keep = keep  # the tensors stay published until it closes (after the push)
        self.path = Path(path)
        self.dtypes = {name: meta.dtype for name, meta in header}
        self.metadata = {str(k): str(v) for k, v in metadata.items()}
        self.items: list[tuple[str, torch.Tensor]] = []

    def write(self, name: str, tensor: torch.Tensor, cast: bool = False) -> None:
        want = self.dtypes[name]
        if tensor.dtype != want and not cast:
            raise CheckpointError(self.path, f"sent as {tensor.dtype}, planned as {want}", name)
        self.items.append((name, tensor.detach().to(want)))

    def finish(self) -> SavedCheckpoint:
        """Publish the tensors; the saved checkpoint's path is the name to push."""
        nbytes = sum(t.numel() * t.element_size() for _, t in self.items)
        name = self.keep.enter_context(published(self.items, self.metadata))
        return SavedCheckpoint(Path(name), nbytes, "", 0.0)

    def abort(self) -> None:
        self.items = []
