"""The sync's directory, the same on every rank: rank zero places it by the file policy
(:func:`weight_bridge.sync.retention.place`), every rank gets it by broadcast, and a RAM
default that does not fit is a warning naming why. Every rank holds a RAM directory as one of
its owners (:func:`weight_bridge.sync.run_dirs.claim`) until the run ends, so the next
run removes it only if this one was killed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from weight_bridge.sync import CheckpointFiles
from weight_bridge.sync.retention import make_dir, place
from weight_bridge.sync.run_dirs import claim


def open_dir(
    files: CheckpointFiles,
    trainer: Any,
    need_bytes: int,
    engine: Any,
    builds: bool,
    partial: bool = True,
) -> tuple[Path, bool, int | None]:
    """Every rank: rank zero's :func:`place` (warning when RAM was the default but does not
    fit), the node's subdirectory with ``node_local``, created; whether it is in RAM; and, in
    RAM, the descriptor that holds the run's directory (close it when the run ends).
    ``engine``: the one given (its checkpoint root counts), or None; ``builds``: the callback
    starts the engine itself; ``partial``: whether syncs may be partial."""
    from lightning.pytorch.utilities import rank_zero_warn

    log_dir = trainer.log_dir or trainer.default_root_dir
    root = getattr(engine, "checkpoint_root", None)
    where = place(files, log_dir, need_bytes, builds, root, partial=partial)
    directory, in_ram, fallback = trainer.strategy.broadcast(
        (str(where.directory), where.in_ram, where.fallback)
    )
    if fallback is not None:
        rank_zero_warn(f"weight_sync: checkpoints go to {directory}, not to RAM: {fallback}")
    path = Path(directory)
    if files.node_local:
        path = path / f"node{trainer.node_rank}"
    make_dir(path, private=in_ram)
    return path, in_ram, claim(Path(directory)) if in_ram else None
