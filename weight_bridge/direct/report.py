"""What a write reports: tensors and bytes written, what was refreshed or re-processed, the
read-back, and the time each step took.

Why a module of its own: every writer of an update (:mod:`.writer`: the direct session, a
delta's scatters, vLLM's own reloads) returns one, and several writers of one update add
theirs up (:meth:`ReloadReport.add`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .resolve import Relocation


@dataclass
class ReloadReport:
    """What a direct reload wrote, what it refreshed or re-processed, and how long it took.

    ``threads``: how many threads its split jobs ran on (the caller's and its helpers on spare
    CPUs, :mod:`.parallel`)."""

    tensors: int = 0
    bytes: int = 0
    direct: int = 0
    refreshed: dict[str, str] = field(default_factory=dict)
    reprocessed: dict[str, str] = field(default_factory=dict)
    verified_writes: int = 0
    relocations: list[Relocation] = field(default_factory=list)
    preflight_s: float = 0.0
    write_s: float = 0.0
    refresh_s: float = 0.0
    readback_s: float = 0.0
    elapsed_s: float = 0.0
    recovered_from_undefined: str | None = None
    threads: int = 1
    changed: int = 0  # elements a delta wrote (0: not a delta)
    # a delta's tensors this worker holds a shard of: [want, base, change (16 hex digits
    # each), changed elements held here, changed elements in all], summed by the engine core;
    # with readback="full" also [this shard's part of the full fingerprint read back (16 hex
    # digits), elements held here, elements in all] (write_map.held_fingerprint)
    shard_fingerprints: dict[str, list] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)  # name -> dtype held (patchable)

    def add(self, other: ReloadReport) -> None:
        """Add the report of another writer of the same update
        (:class:`~weight_bridge.direct.writer.Writers`)."""
        self.tensors += other.tensors
        self.bytes += other.bytes
        self.direct += other.direct
        self.verified_writes += other.verified_writes
        self.changed += other.changed
        self.preflight_s += other.preflight_s
        self.write_s += other.write_s
        self.refresh_s += other.refresh_s
        self.readback_s += other.readback_s
        self.elapsed_s += other.elapsed_s
        self.refreshed.update(other.refreshed)
        self.reprocessed.update(other.reprocessed)
        self.shard_fingerprints.update(other.shard_fingerprints)
        self.dtypes.update(other.dtypes)
        self.relocations += other.relocations
        self.threads = max(self.threads, other.threads)
        self.recovered_from_undefined = (
            self.recovered_from_undefined or other.recovered_from_undefined
        )
