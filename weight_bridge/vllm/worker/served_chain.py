"""One worker's served chain: the checkpoints its weights are made of (a complete one, then
partial ones on top of it), each file held open and shared-locked
(:class:`~weight_bridge.checkpoint.held.HeldFile`) so that a rollback re-reads exactly the
bytes that were served, through the descriptor, its identity checked first, or refuses by name.
Clients learn the chain from the workers' answer
(:attr:`~weight_bridge.vllm.outcome.PushResult.served`); nothing else keeps one.

The chain stays bounded however long a run is: a link whose every tensor a later link also
holds whole is dropped (:func:`compact`), so a run of partial checkpoints that each carry every
trainable tensor keeps its complete base and its newest partial only. A delta's sparse tensors
patch what is below them, so they cover nothing: a chain of deltas is kept whole, down to its
keyframe (the trainer's keyframes bound it), and the newest delta alone keeps its undo log (its
pre-images: a rollback of an update undoes only what that update wrote), so rolling it back is
O(delta) and reads no file, and the logs held never add up over a chain.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...checkpoint import CheckpointError, CheckpointReader
from ...checkpoint.held import HeldFile
from ...delta.format import split_name
from ...direct.errors import BaseVersionError
from ...direct.undo import UndoLog


@dataclass
class ServedCheckpoint:
    """One checkpoint of the served version: its path (for messages and clients), the version
    it was pushed as, its tensors' names (a delta's sparse ones under their own name), its
    files, held, and for a delta its undo log."""

    path: str
    version: Any
    files: list[HeldFile] = field(default_factory=list)
    names: frozenset[str] = frozenset()
    undo: UndoLog | None = None
    # what the weights served up to this link are, by content (delta.format.lineage_of;
    # None: not fingerprinted, so nothing can be proven to apply on top of it)
    lineage: str | None = None
    in_memory: bool = False  # pushed from memory: no file, the host store rolls it back
    patches: frozenset[str] = field(init=False, default=frozenset())

    def __post_init__(self) -> None:
        split = [split_name(n) for n in self.names]
        self.names = frozenset(n for n, _ in split)
        self.patches = frozenset(n for n, part in split if part)  # sparse: they cover nothing

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
        self.undo = None


def hold(path: str) -> ServedCheckpoint:
    """A link for the checkpoint at ``path`` (a file or a directory of shards), its files held
    now; a checkpoint that cannot be opened is a link with no file (it cannot be re-read, and
    a rollback onto it refuses by name)."""
    try:
        reader = CheckpointReader(path, hold=True)
    except CheckpointError:
        return ServedCheckpoint(path, None)
    try:
        return ServedCheckpoint(path, None, reader.take_held(), frozenset(reader.specs()))
    finally:
        reader.close()


def compact(chain: list[ServedCheckpoint]) -> tuple[list[ServedCheckpoint], list]:
    """``chain`` without the links every tensor of which a later link holds too (re-writing
    the rest in order gives the same weights); and the links dropped."""
    kept: list[ServedCheckpoint] = []
    dropped: list[ServedCheckpoint] = []
    later: set[str] = set()  # what later links hold whole
    for link in reversed(chain):
        if link is not chain[0] and link.names and link.names <= later:
            dropped.append(link)
        else:
            kept.append(link)
        later |= link.names - link.patches
    return kept[::-1], dropped


def check_lineage(path: str, base: str, wanted: str | None, served: list[ServedCheckpoint]) -> None:
    """A checkpoint whose writer named the lineage of its base (``wanted``) applies only on
    weights of that lineage: the same label on other weights (another trainer's) is not its
    base. The lineage of what is ``served`` is its newest link's."""
    if wanted is None:
        return
    serving = served[-1].lineage if served else None
    if serving == wanted:
        return
    what = f"weights of lineage {serving[:12]}" if serving else "weights of no known lineage"
    raise BaseVersionError(
        f"checkpoint {path} applies on top of version {base!r} as its writer wrote it "
        f"(lineage {wanted[:12]}), but under that label the engine serves {what}: another "
        "writer's weights; push a complete checkpoint (nothing was written)"
    )
