"""Where a sync's checkpoint files live, what they are named, and which of them may be deleted:
the one file policy of every trainer-side writer (the Lightning callback's
:class:`~callbacks.VLLMWeightSync` and vLLM's trainer API,
:class:`~weight_bridge.vllm.clients.trainer_api.WeightBridgeTrainer`).

Each sync's file is *transport* from the trainer to a colocated engine, not an archive: unless
told otherwise it goes to a private directory in RAM (``/dev/shm``), is never fsynced, and only
what the engine needs is kept (the file it serves and, after partial pushes, every file the
served version is made of: a rollback re-reads them all). A checkpoint is never deleted while
an engine needs it. Checkpoints a user wants to keep go where ``dirpath`` says, fsynced with
``durable=True``. Every writer names its files :func:`step_file` (``step-{step:08d}``), and
:func:`prune` keeps the newest ``keep_last_k`` of them besides those an engine serves.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.held import try_lock_exclusive
from ..checkpoint.space import is_tmpfs
from ..layout import storage_start
from .run_dirs import new_run_dir_name, remove_orphans

_STEP_FILE = re.compile(r"^step-(\d+)\.(?:safetensors|adapter)$")  # adapter: a PEFT directory
_STEP_GLOB = "step-*"
SPARE = ".spare"  # a transport file no engine needs any more, whose pages the next write reuses
RAM_ROOT = Path("/dev/shm")  # tmpfs: the transport's default home
RAM_MARGIN = 64 * 2**20  # left free in RAM beyond the checkpoints themselves


@dataclass(frozen=True)
class CheckpointFiles:
    """Where each sync's ``step-{step:08d}.safetensors`` goes, how many are kept, how durable.

    * default (no ``dirpath``, ``ram_dir=None``): the file is transport. When the callback builds
      the engine (``model_path``), or the engine's checkpoint root is itself in RAM, it goes to a
      private (0700) directory in ``/dev/shm`` that the engine reads from, removed at teardown;
      if ``/dev/shm`` is missing or has too little room for the files a sync holds at once
      (:func:`held_files`: ``keep_last_k + 1`` checkpoints, one more while syncs may be
      partial, plus 64 MiB), the callback warns, saying which, and writes to
      ``<trainer.log_dir>/weight_sync`` instead (as it does for any other engine). A run's
      directory is removed at its end (SIGTERM included); one a SIGKILLed run left is removed
      by the next run's start (:mod:`.run_dirs`).
    * ``dirpath``: write there, whatever filesystem it is on (``ram_dir=True`` still wins).
    * ``ram_dir=True``: RAM, whatever the engine; ``ram_dir=False``: never RAM.
    * ``durable=True``: fsync every checkpoint and its directory after the rename, so a saved
      checkpoint survives a crash of the machine (never in RAM: the default directory is then
      ``<trainer.log_dir>/weight_sync``). Transport files are not fsynced: the engine reads them
      from the page cache, and a reboot ends the engine too.

    Checkpoints beyond the newest ``keep_last_k`` (default: 1 in RAM, 2 on disk) are deleted
    after a successful push, except those an engine serves; a sync that fails leaves no file of
    its own behind. ``node_local=True`` is the multi-node layout: each node's local rank zero
    writes its own copy into ``<dir>/node<node_rank>`` (a node-local disk or ``/dev/shm`` at the
    same path on every node) and every rank pushes from its own node's copy, so no node waits on
    another node's disk. The engine built by the callback may read checkpoints from this
    directory only.
    """

    dirpath: str | None = None
    ram_dir: bool | None = None
    keep_last_k: int | None = None
    node_local: bool = False
    durable: bool = False

    def __post_init__(self) -> None:
        if self.keep_last_k is not None and self.keep_last_k < 1:
            raise ValueError(f"keep_last_k must be >= 1, not {self.keep_last_k}")
        if self.ram_dir and self.durable:
            raise ValueError(
                "durable=True fsyncs checkpoints so that they survive a crash, which a file in "
                "RAM (ram_dir=True) cannot: pass one of them"
            )

    def keep(self, in_ram: bool) -> int:
        """How many of the newest step files prune keeps (besides those an engine serves)."""
        if self.keep_last_k is not None:
            return self.keep_last_k
        return 1 if in_ram else 2


@dataclass(frozen=True)
class Placement:
    """Where a run's checkpoints go: the directory, whether it is the RAM transport (a private
    directory of this run, removed at its end), and why not RAM when RAM was the default but
    could not be used (for the warning)."""

    directory: Path
    in_ram: bool
    fallback: str | None = None


def step_file(directory: Path, step: int) -> Path:
    """The file of the sync at ``step`` (a counter for a writer with no steps): every writer's
    name, the one :func:`prune` orders by."""
    return directory / f"step-{step:08d}.safetensors"


def adapter_dir(directory: Path, step: int) -> Path:
    """The PEFT directory of an adapter sync at ``step`` (:mod:`.adapter`): a step file to
    :func:`prune`, ordered with the others."""
    return directory / f"step-{step:08d}.adapter"


def _remove(path: Path) -> None:
    """Delete a step file, or an adapter's directory (the engine keeps its own copy of it)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def unused_step(directory: Path) -> int:
    """The first step number after every step file in ``directory``: a writer that counts its
    own sends (vLLM's trainer API) starts there, so a restarted one never reuses a name an
    engine's chain may still carry."""
    return max((step for step, _ in _step_files(directory)), default=0) + 1


def _step_files(directory: Path) -> list[tuple[int, Path]]:
    """The step files of ``directory``, oldest first."""
    found = ((_STEP_FILE.match(f.name), f) for f in directory.glob(_STEP_GLOB))
    return sorted((int(m.group(1)), f) for m, f in found if m)


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer can still store on ``path``'s filesystem."""
    return shutil.disk_usage(path).free


def estimate_bytes(state: Mapping[str, Any], cast: torch.dtype | None = None) -> int:
    """The data bytes of a checkpoint of ``state`` (tied tensors once), from metadata alone;
    floating tensors at ``cast``'s size when given."""
    seen: set[tuple[str, int, int]] = set()
    total = 0
    for t in state.values():
        if not isinstance(t, torch.Tensor):
            continue
        if t.device.type != "meta" and t.numel():
            key = storage_start(t)
            if key in seen:
                continue
            seen.add(key)
        size = cast.itemsize if cast is not None and t.is_floating_point() else t.element_size()
        total += t.numel() * size
    return total


def _ram_candidate(engine_root: str | None, builds_engine: bool) -> Path | None:
    """The RAM root the transport may use: ``/dev/shm`` when the callback builds the engine, or
    the given engine's checkpoint root when it is on a tmpfs (it reads nowhere else)."""
    if builds_engine:
        return RAM_ROOT
    if engine_root is not None and is_tmpfs(Path(engine_root)):
        return Path(engine_root)
    return None


def held_files(keep_last_k: int, partial: bool) -> int:
    """How many checkpoints the transport holds at once, at most: the newest ``keep_last_k``
    (the served one among them), the one being written (a recycled spare), and, while syncs
    may be partial, the complete checkpoint their chain rests on. The served chain keeps no
    more (:func:`~weight_bridge.vllm.worker.served_chain.compact`), however long the run."""
    return keep_last_k + 1 + int(partial)


def place(
    files: CheckpointFiles,
    log_dir: str,
    need_bytes: int,
    builds_engine: bool,
    engine_root: str | None = None,
    free: Callable[[Path], int] | None = None,
    partial: bool = True,
) -> Placement:
    """Where this run's checkpoints go (see :class:`CheckpointFiles`); ``need_bytes``: one
    checkpoint's size, to check RAM's free space against (``free``: the check, for tests);
    ``partial``: whether syncs may be partial (the chain then holds a complete base besides).
    Choosing RAM first removes the directories killed runs of this user left there."""
    disk = Path(files.dirpath) if files.dirpath is not None else Path(log_dir) / "weight_sync"
    name = new_run_dir_name()
    if files.ram_dir:  # as before: a private directory, removed at the end, in /tmp without RAM
        ram = RAM_ROOT if RAM_ROOT.is_dir() else Path(tempfile.gettempdir())
        remove_orphans(ram)
        return Placement(ram / name, in_ram=True)
    if files.ram_dir is False or files.dirpath is not None or files.durable:
        return Placement(disk, in_ram=False)
    root = _ram_candidate(engine_root, builds_engine)
    if root is None:
        return Placement(disk, in_ram=False)
    if not root.is_dir():
        return Placement(disk, False, f"{root} does not exist")
    remove_orphans(root)
    held = held_files(files.keep(in_ram=True), partial)
    want = held * need_bytes + RAM_MARGIN
    try:
        room = (free or free_bytes)(root)
    except OSError as exc:
        return Placement(disk, False, f"the free space of {root} cannot be read: {exc}")
    if room < want:
        return Placement(
            disk,
            False,
            f"{root} has {room / 2**20:.0f} MiB free, and a sync holds {held} checkpoints of "
            f"{need_bytes / 2**20:.0f} MiB there at once (plus {RAM_MARGIN // 2**20} MiB "
            "to spare)",
        )
    return Placement(root / name, in_ram=True)


def make_dir(directory: Path, private: bool) -> None:
    """Create ``directory``; a ``private`` one (the RAM transport's) is 0700 and must be ours."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700 if private else 0o777)
    if private:
        info = directory.stat()
        if info.st_uid != os.geteuid():
            raise PermissionError(f"{directory} exists and belongs to uid {info.st_uid}")
        os.chmod(directory, 0o700)


def prune(
    directory: Path,
    current: Path,
    keep_last_k: int,
    served: Iterable[str | os.PathLike[str]],
    spare: bool = False,
) -> None:
    """Delete all but the newest ``keep_last_k`` step files, never ``current`` or one served.

    ``spare`` (the RAM transport): the first file to go is renamed to :data:`SPARE` instead,
    for the next sync's writer to overwrite in place (its pages are allocated already)."""
    keep = {current.resolve(), *(Path(p).resolve() for p in served)}
    for _, f in _step_files(directory)[:-keep_last_k]:
        if f.resolve() in keep:
            continue
        if not (
            spare and f.is_file() and not (directory / SPARE).exists() and _renamed_unheld(f, SPARE)
        ):
            _remove(f)  # an engine holding it keeps its bytes: its descriptor


def _renamed_unheld(f: Path, name: str) -> bool:
    """Rename ``f`` to ``name`` in its directory if no engine holds it (an exclusive lock is
    free, and held across the rename): a file an engine may re-read is never made a spare."""
    try:
        fd = os.open(f, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        if not try_lock_exclusive(fd):
            return False
        os.rename(f, f.parent / name)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def discard(path: Path, engine: Any) -> None:
    """Remove the file of a sync that failed, unless ``engine`` serves it (kept too when the
    engine cannot say: the file may be what it serves)."""
    try:
        served = engine.served_checkpoints if engine is not None else ()
    except Exception:
        return
    if path.resolve() not in {Path(p).resolve() for p in served}:
        _remove(path)


@dataclass
class StepFiles:
    """The file policy of a sender with no transport of its own (vLLM's trainer API): every
    file written as the writer's defaults, the newest ``keep_last_k`` kept after a sync besides
    what the engine serves, a failed sync's file removed unless ``engine`` serves it."""

    keep_last_k: int
    engine: Any = None

    def options(self) -> dict[str, Any]:
        return {}

    def retire(self, path: Path, served: Iterable[Any]) -> None:
        prune(path.parent, path, max(self.keep_last_k, 1), served)

    def discard(self, path: Path) -> None:
        discard(path, self.engine)


def release(directory: Path, served: Iterable[str | os.PathLike[str]]) -> None:
    """At the end of a run: remove the directory, or, while an engine still serves from it,
    every step file but those it serves."""
    keep = {Path(p).resolve() for p in served}
    if not keep:
        shutil.rmtree(directory, ignore_errors=True)
        return
    (directory / SPARE).unlink(missing_ok=True)
    for _, f in _step_files(directory):
        if f.resolve() not in keep:
            _remove(f)
