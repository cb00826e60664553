"""Filesystem calls of the writer: its temporary file (new, or a recycled one), removing those of
dead writers, reserving a file's space up front, making a rename durable; whether a path is in RAM
(:func:`is_tmpfs`)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import os
import re
import secrets
import stat
import tempfile
import time
from pathlib import Path

STALE_TEMP_AGE_S = 60.0  # an unlocked temporary file this old belongs to a dead writer
_TEMP_NAME = re.compile(r"^\.(?P<target>.+)\.[a-z0-9_]{8}\.tmp$")  # mkstemp's 8 characters
_TEMP_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789_"


def open_temp(path: Path, reuse: str | os.PathLike | None = None) -> tuple[int, str]:
    """A new owner-only temporary file for ``path`` in its directory (fd, name).

    ``reuse``: a file of ours in the same directory that is no longer needed (a transport file
    no engine serves); it is renamed to the temporary name, atomically, and overwritten in place,
    so the write finds its pages allocated (on tmpfs, allocating and zeroing fresh pages costs
    more than the copy itself). It is used only if it is a regular file, owned by this user,
    mode 0600, not a link; otherwise (or if it is gone) a new file is made.
    """
    remove_stale_temps(path)
    if reuse is not None and Path(reuse).parent == path.parent:
        recycled = _recycle(path, Path(reuse))
        if recycled is not None:
            return recycled
    # mkstemp creates the file 0600 (owner-only) with O_EXCL, whatever the umask: no byte is
    # ever readable by others, and os.replace keeps the mode.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    return fd, tmp


def _recycle(path: Path, reuse: Path) -> tuple[int, str] | None:
    """``reuse`` opened, checked, locked, touched and renamed to a temporary name of ``path``
    (the lock and the fresh mtime keep :func:`remove_stale_temps` off it); None if unusable."""
    try:
        fd = os.open(reuse, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not (
            stat.S_ISREG(st.st_mode)
            and st.st_uid == os.geteuid()
            and stat.S_IMODE(st.st_mode) == 0o600
        ):
            raise OSError(errno.EPERM, "not a private regular file")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.utime(fd)
        name = f".{path.name}.{''.join(secrets.choice(_TEMP_CHARS) for _ in range(8))}.tmp"
        tmp = str(path.parent / name)
        os.rename(reuse, tmp)
    except OSError:
        os.close(fd)
        return None
    return fd, tmp


def remove_stale_temps(path: Path) -> None:
    """Delete temporary files of earlier saves into ``path``'s directory whose writer is gone.

    Only names :func:`~.write.save_checkpoint` makes are considered (``.<name>.<8 random>.tmp`` for
    this ``path`` or any ``*.safetensors``). A live writer holds an exclusive lock on its
    file; a killed one's lock went with it. The age test closes the window between a writer
    creating its file and locking it.
    """
    now = time.time()
    for tmp in path.parent.iterdir():
        m = _TEMP_NAME.match(tmp.name)
        if m is None or not (m["target"] == path.name or m["target"].endswith(".safetensors")):
            continue
        try:
            fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or now - st.st_mtime < STALE_TEMP_AGE_S:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        except OSError:
            continue  # locked: a writer is still at work
        finally:
            os.close(fd)


def create_reserved(path: Path, size: int) -> int | None:
    """A new owner-only (0600) file at ``path``, ``size`` bytes long with every page allocated,
    open read-write (its descriptor); None, leaving nothing behind, where the space cannot be
    reserved (a full filesystem, or one without ``fallocate``)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError:
        return None
    try:
        os.fchmod(fd, 0o600)
        if not reserve(fd, 0, size):
            raise OSError(errno.EOPNOTSUPP, "fallocate is not supported")
        os.ftruncate(fd, size)
    except OSError:
        os.close(fd)
        path.unlink(missing_ok=True)
        return None
    return fd


_FALLOC_FL_KEEP_SIZE = 1
_NOT_SUPPORTED = {errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def reserve(fd: int, offset: int, length: int) -> bool:
    """Reserve ``length`` bytes at ``offset`` (fallocate with ``FALLOC_FL_KEEP_SIZE``: the
    file's size is unchanged, so a reader sees no bytes that were not written): a filesystem
    without room refuses the whole checkpoint here (ENOSPC, EFBIG) instead of half-way through.
    Where the call is not supported nothing is reserved (False) and the writes themselves find
    out."""
    if length <= 0 or _stored(fd, offset + length):
        return True
    fallocate = _libc_fallocate()
    if fallocate is None:
        return False
    if fallocate(fd, _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        if err not in _NOT_SUPPORTED:
            raise OSError(err, os.strerror(err))
        return False
    return True


def _stored(fd: int, size: int) -> bool:
    """Whether the first ``size`` bytes of the file are all stored, no hole among them: a
    recycled file overwritten in place needs no new space (and reserving it again would walk
    every page). The file position is left where it was."""
    try:
        if os.fstat(fd).st_size < size:
            return False
        at = os.lseek(fd, 0, os.SEEK_CUR)
        try:
            return os.lseek(fd, 0, os.SEEK_HOLE) >= size
        finally:
            os.lseek(fd, at, os.SEEK_SET)
    except OSError:  # no SEEK_HOLE here: reserve
        return False


@functools.cache
def _libc_fallocate():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.fallocate64
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (best effort: not every filesystem allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def is_tmpfs(path: Path) -> bool:
    """Whether ``path`` lies on a tmpfs (its longest mount point's type): files there are host
    memory."""
    try:
        resolved = path.resolve()
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return False
    best, kind = -1, ""
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = Path(parts[1].replace("\\040", " "))
        if (resolved == point or point in resolved.parents) and len(str(point)) > best:
            best, kind = len(str(point)), parts[2]
    return kind == "tmpfs"
