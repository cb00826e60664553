"""A checkpoint file an engine holds: an open descriptor, a shared lock, and the file's identity.

Why: a transport file is short-lived and recycled (:mod:`.space`), and names get reused (a new
run in the same directory, a restarted trainer). A rollback that re-reads a *name* can get
finite, well-shaped bytes of another version, which no check of the engine would catch. So an
engine holds every file of what it serves by descriptor, and re-reads only through it:

* the shared lock (``flock(LOCK_SH)``) tells every writer that an engine may re-read the file:
  a writer recycles a file only if it can lock it exclusively, so it never writes into one
  that any engine (in any process: a second engine, ``vllm serve``) holds;
* the identity recorded when the lock was taken (device, inode, size, modification time, and
  the content hash of the header where the writer wrote one) is checked before every re-read:
  a file changed by anything that ignores the lock is refused by name, never read.

A descriptor keeps the file's bytes alive after its name is deleted or replaced, so deleting
or replacing a name never changes what an engine re-reads.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError

_LOCK_WAIT_S = 5.0  # a writer holds its exclusive lock only while it recycles a file


@dataclass(frozen=True)
class FileIdentity:
    """What a file was when an engine took it: any change to its bytes by a writer changes one
    of these (a write or truncate moves ``mtime_ns``; a rewrite by this project's writer also
    changes ``stamp``, the header's content hash, where it has one)."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    stamp: str | None = None

    def differences(self, now: FileIdentity) -> list[str]:
        """What changed from ``self`` to ``now``, in words (empty: the same file, unchanged)."""
        out = []
        for field, label in (
            ("device", "device"),
            ("inode", "inode"),
            ("size", "size"),
            ("mtime_ns", "modification time"),
            ("stamp", "content hash in its header"),
        ):
            was, is_ = getattr(self, field), getattr(now, field)
            if was != is_:
                out.append(f"{label} {was} -> {is_}")
        return out


class HeldFile:
    """One file held open, shared-locked, by the process that may re-read it.

    ``path`` is the name it was opened by (for messages); :attr:`via` is the name that reaches
    the held descriptor itself (``/proc/self/fd/N``), which is what every re-read opens."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.fd: int | None = _open_locked(self.path)
        self.identity = self._identity(None)

    @property
    def via(self) -> Path:
        if self.fd is None:
            raise CheckpointError(self.path, "no longer held (released)")
        return Path(f"/proc/self/fd/{self.fd}")

    def stamped(self, stamp: str | None) -> None:
        """Record the header's content hash (read once the header was parsed)."""
        self.identity = self._identity(stamp)

    def _identity(self, stamp: str | None) -> FileIdentity:
        assert self.fd is not None
        st = os.fstat(self.fd)
        return FileIdentity(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, stamp)

    def check(self, stamp: str | None) -> None:
        """Refuse, naming the file and what changed, unless it is as it was when taken
        (``stamp``: the content hash its header has now)."""
        if self.fd is None:
            raise CheckpointError(self.path, "no longer held (released): it cannot be re-read")
        changed = self.identity.differences(self._identity(stamp))
        if changed:
            raise CheckpointError(
                self.path,
                "changed since the engine took it (" + "; ".join(changed) + "): its bytes are "
                "not the version served, so it is not re-read",
            )

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)  # the lock goes with the last descriptor of this open file
            self.fd = None


def _open_locked(path: Path) -> int:
    """``path`` opened read-only and shared-locked, still the file the name points to: a file
    renamed away (recycled) between the open and the lock is opened again."""
    deadline = time.monotonic() + _LOCK_WAIT_S
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            raise CheckpointError(path, f"cannot open: {exc.strerror or exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            if _same_file(fd, path):
                return fd
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                os.close(fd)
                raise CheckpointError(path, f"cannot lock: {exc.strerror or exc}") from exc
        os.close(fd)
        if time.monotonic() > deadline:
            raise CheckpointError(
                path, f"a writer kept it locked (or kept replacing it) for {_LOCK_WAIT_S:.0f} s"
            )
        time.sleep(0.01)


def _same_file(fd: int, path: Path) -> bool:
    try:
        st, now = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)


def try_lock_exclusive(fd: int) -> bool:
    """Lock the open file ``fd`` exclusively, without waiting: False if any engine holds it
    (a writer may then neither recycle it nor write into it)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True
