"""Which checkpoint paths an engine may read: only under a root fixed when it starts.

An update over HTTP names a file path. An engine that opened any path it was sent would read
(and serve the contents of) whatever its user can read, and would load weights another local
user placed there. So a bridged engine reads only under its *checkpoint root*, set in its
configuration when it starts, never by a request, and :func:`trusted_checkpoint` refuses by
name:

* a path that resolves outside the root (``..``, an absolute path elsewhere, a symlink at any
  level that leads out);
* a file or directory (the checkpoint, its shards and index, and every directory from the root
  down to them) not owned by the engine's user, or writable by its group or by others: another
  user could swap its contents between the check and the read. The root itself may also be
  owned by the system (uid 0) and writable by all if it is sticky, as ``/tmp`` is: there no one
  can rename or replace another user's entries.

What passes is the resolved path, which the caller then opens.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import CheckpointError
from .format import INDEX_NAME

ROOT_HINT = (
    "set the engine's checkpoint root when it starts: "
    'additional_config={"weight_bridge": {"checkpoint_root": DIR}} '
    '(vllm serve: --additional-config \'{"weight_bridge": {"checkpoint_root": "DIR"}}\')'
)


def _check_owned(path: Path, what: str, root: bool = False) -> None:
    info = path.stat()
    if root and info.st_uid in (0, os.geteuid()) and info.st_mode & stat.S_ISVTX:
        return  # a sticky directory such as /tmp: entries stay their owners'
    if info.st_uid != os.geteuid():
        raise CheckpointError(
            path,
            f"{what} is owned by uid {info.st_uid}, not by the engine's user "
            f"(uid {os.geteuid()}): refused",
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CheckpointError(
            path,
            f"{what} is writable by its group or by others "
            f"(mode {stat.S_IMODE(info.st_mode):04o}): refused",
        )


def trusted_checkpoint(path: str | os.PathLike, root: str | os.PathLike | None) -> Path:
    """``path`` resolved, if it is a checkpoint the engine may read under ``root``; else a
    :class:`CheckpointError` naming what is wrong (with ``root`` None: how to set one)."""
    if root is None:
        raise CheckpointError(
            path, f"this engine has no checkpoint root, so it reads none: {ROOT_HINT}"
        )
    try:
        base = Path(root).resolve(strict=True)
    except OSError as exc:
        raise CheckpointError(root, f"the checkpoint root cannot be opened: {exc}") from None
    given = Path(path)
    if not given.is_absolute():
        given = base / given
    try:
        resolved = given.resolve(strict=True)
    except FileNotFoundError:
        raise CheckpointError(path, "no such checkpoint file or directory") from None
    except (OSError, RuntimeError) as exc:  # symlink loops, bad names
        raise CheckpointError(path, f"cannot resolve the checkpoint path: {exc}") from None
    if resolved != base and not resolved.is_relative_to(base):
        raise CheckpointError(
            path, f"resolves to {resolved}, outside the engine's checkpoint root {base}: refused"
        )
    _check_owned(base, "the checkpoint root", root=True)
    for parent in reversed(resolved.parents):
        if parent.is_relative_to(base) and parent != base:
            _check_owned(parent, f"directory {parent}")
    if resolved.is_dir():
        _check_owned(resolved, "the checkpoint directory")
        for f in sorted(resolved.iterdir()):
            if f.suffix == ".safetensors" or f.name == INDEX_NAME:
                _check_owned(f, f"file {f.name}")
    else:
        _check_owned(resolved, "the checkpoint file")
    return resolved
