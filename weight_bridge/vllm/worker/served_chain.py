"""One worker's served chain: the checkpoints its weights are made of (a complete one, then
partial ones on top of it), each file held open and shared-locked
(:class:`~weight_bridge.checkpoint.held.HeldFile`) so that a rollback re-reads exactly the
bytes that were served, through the descriptor, its identity checked first, or refuses by name.
Clients learn the chain from the workers' answer
(:attr:`~weight_bridge.vllm.outcome.PushResult.served`); nothing else keeps one.

The chain stays bounded however long a run is: a link whose every tensor a later link also
holds is dropped (:func:`compact`), so a run of partial checkpoints that each carry every
trainable tensor keeps its complete base and its newest partial only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...checkpoint import CheckpointError, CheckpointReader
from ...checkpoint.held import HeldFile

__all__ = ["ServedCheckpoint", "compact", "hold"]


@dataclass
class ServedCheckpoint:
    """One checkpoint of the served version: its path (for messages and clients), the version
    it was pushed as, its tensors' names, and its files, held."""

    path: str
    version: Any
    files: list[HeldFile] = field(default_factory=list)
    names: frozenset[str] = frozenset()

    def reader(self) -> CheckpointReader:
        """The checkpoint as it was served, read through the held descriptors; a file that
        changed since (or is no longer held) raises ``CheckpointError`` naming it and what
        changed."""
        if not self.files:
            raise CheckpointError(self.path, "not held by the engine: it cannot be re-read")
        return CheckpointReader(self.path, held=self.files)

    def release(self) -> None:
        for f in self.files:
            f.release()
        self.files = []


def hold(path: str, version: Any = None) -> ServedCheckpoint:
    """A link for the checkpoint at ``path`` (a file or a directory of shards), its files held
    now; a checkpoint that cannot be opened is a link with no file (it cannot be re-read, and
    a rollback onto it refuses by name)."""
    try:
        reader = CheckpointReader(path, hold=True)
    except CheckpointError:
        return ServedCheckpoint(path, version)
    try:
        return ServedCheckpoint(path, version, reader.take_held(), frozenset(reader.specs()))
    finally:
        reader.close()


def compact(chain: list[ServedCheckpoint]) -> tuple[list[ServedCheckpoint], list]:
    """``chain`` without the links every tensor of which a later link holds too (re-writing
    the rest in order gives the same weights); and the links dropped."""
    kept: list[ServedCheckpoint] = []
    dropped: list[ServedCheckpoint] = []
    later: set[str] = set()
    for link in reversed(chain):
        if link is not chain[0] and link.names and link.names <= later:
            dropped.append(link)
        else:
            kept.append(link)
        later |= link.names
    return kept[::-1], dropped
