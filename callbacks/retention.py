"""Where the sync's checkpoints live, and which of them may be deleted.

A checkpoint is never deleted while an engine needs it: the one it serves and, after partial
pushes, every file the served version is made of (a rollback re-reads them all).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CheckpointFiles", "prune", "release", "sync_dir"]

_STEP_FILE = re.compile(r"^step-(\d+)\.safetensors$")


@dataclass(frozen=True)
class CheckpointFiles:
    """Where each sync's ``step-{step:08d}.safetensors`` goes, and how many are kept.

    ``dirpath`` (default ``<trainer.log_dir>/weight_sync``); ``ram_dir=True``: a private
    directory in ``/dev/shm`` instead, removed at teardown. Checkpoints beyond the newest
    ``keep_last_k`` are deleted after a successful push, except those an engine serves.
    ``node_local=True`` is the multi-node layout: each node's local rank zero writes its own
    copy into ``<dir>/node<node_rank>`` (a node-local disk or ``/dev/shm`` at the same path on
    every node) and every rank pushes from its own node's copy, so no node waits on another
    node's disk. The engine built by the callback may read checkpoints from this directory only.
    """

    dirpath: str | None = None
    ram_dir: bool = False
    keep_last_k: int = 2
    node_local: bool = False

    def __post_init__(self) -> None:
        if self.keep_last_k < 1:
            raise ValueError(f"keep_last_k must be >= 1, not {self.keep_last_k}")


def sync_dir(ram_dir: bool, dirpath: str | None, log_dir: str) -> Path:
    """``ram_dir``: a private directory in ``/dev/shm``; else ``dirpath`` or
    ``<log_dir>/weight_sync``."""
    if ram_dir:
        shm = Path("/dev/shm")
        root = shm if shm.is_dir() else Path(tempfile.gettempdir())
        return root / f"weight_bridge-{os.getpid()}"
    if dirpath is not None:
        return Path(dirpath)
    return Path(log_dir) / "weight_sync"


def prune(directory: Path, current: Path, keep_last_k: int, served: Iterable[str]) -> None:
    """Delete all but the newest ``keep_last_k`` step files, never ``current`` or one served."""
    keep = {current.resolve(), *(Path(p).resolve() for p in served)}
    found = []
    for f in directory.glob("step-*.safetensors"):
        m = _STEP_FILE.match(f.name)
        if m:
            found.append((int(m.group(1)), f))
    found.sort()
    for _, f in found[:-keep_last_k]:
        if f.resolve() not in keep:
            f.unlink(missing_ok=True)


def release(directory: Path, served: Iterable[str]) -> None:
    """At the end of a run: remove the directory, or, while an engine still serves from it,
    every step file but those it serves."""
    keep = {Path(p).resolve() for p in served}
    if not keep:
        shutil.rmtree(directory, ignore_errors=True)
        return
    for f in directory.glob("step-*.safetensors"):
        if f.resolve() not in keep:
            f.unlink(missing_ok=True)
