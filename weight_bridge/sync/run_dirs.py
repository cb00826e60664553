"""The RAM transport's private directories: one per run, owned while the run lives, removed by
the next run of the same user once its owner is gone.

Why: a run's transport directory in ``/dev/shm`` is RAM until it is deleted. A run that ends
normally, or by SIGTERM (Lightning raises, and the callback's teardown runs), removes its own.
A run killed with SIGKILL cannot: its directory would hold RAM until the machine reboots. So
every process of a run holds a shared lock on the directory's ``.owner`` file for as long as it
runs (the lock goes with the process, however it ends), and the next start of the callback
removes each directory of this user whose owner lock is free and whose creating process is
gone.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import shutil
import stat
from pathlib import Path

from ..checkpoint.held import try_lock_exclusive

OWNER = ".owner"
_NAME = re.compile(r"^weight_bridge-(?P<pid>\d+)-[0-9a-f]{8}$")


def new_run_dir_name() -> str:
    """A run's directory name: its creating process, and 8 random hex digits."""
    return f"weight_bridge-{os.getpid()}-{secrets.token_hex(4)}"


def claim(directory: Path) -> int:
    """Hold ``directory`` as one of its run's owners (every rank of a run may): a shared lock
    on its owner file, kept until the returned descriptor is closed or the process ends."""
    fd = os.open(directory / OWNER, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError:
        os.close(fd)
        raise
    return fd


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process of that number: not ours to judge
    return True


def remove_orphans(root: Path) -> list[Path]:
    """Remove the run directories under ``root`` that belong to this user and whose run is
    gone: its creating process has exited and no process holds its owner lock. Returns them."""
    removed: list[Path] = []
    try:
        children = list(root.iterdir())
    except OSError:
        return removed
    for child in children:
        m = _NAME.match(child.name)
        if m is None or _alive(int(m["pid"])):
            continue
        try:
            st = os.lstat(child)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue
        if _owner_free(child):
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed


def _owner_free(directory: Path) -> bool:
    """Whether no process holds ``directory``'s owner lock (a directory with no owner file is a
    run that died before it took one)."""
    try:
        fd = os.open(directory / OWNER, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        return try_lock_exclusive(fd)
    finally:
        os.close(fd)
