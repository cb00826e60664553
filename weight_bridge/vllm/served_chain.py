"""One worker's served chain: the checkpoints its weights are made of (a complete one, then
partial ones on top of it), each held open so that a rollback can re-read it. Clients learn the
chain from the workers' answer (:attr:`~.results.PushResult.served`); nothing else keeps one."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["ServedCheckpoint", "hold"]


@dataclass
class ServedCheckpoint:
    """One checkpoint of the served version, with a descriptor held open on it (a file) so
    that a rollback can re-read it even if something deleted it meanwhile (a directory of
    shards is re-read by path)."""

    path: str
    version: Any
    fd: int | None = None

    def readable(self) -> str:
        if self.fd is not None and not os.path.exists(self.path):
            return f"/proc/{os.getpid()}/fd/{self.fd}"
        return self.path

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


def hold(path: str) -> int | None:
    """A read-only descriptor on ``path`` if it is a file (a shard directory: None)."""
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC) if os.path.isfile(path) else None
