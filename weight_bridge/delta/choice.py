"""``delta="auto"``: send deltas where they prove cheaper, full syncs where they do not.

A delta saves *bytes*, not necessarily *time*: to find what changed the writer reads and compares
every value with its reference copy, and the engine applies it and re-derives what post-load
processing derived. Where the bytes move through host memory only, that diff alone costs about as
much as a complete sync, and at RL learning rates nearly every value changes
(``docs/benchmarks.md``); where bytes cost more than reading them (a disk or network filesystem,
an accelerator's tensors crossing PCIe) the delta's few bytes can win. So :class:`DeltaChoice`
decides from:

* **where the bytes go** (:func:`host_memory_transport`): files in a tmpfs and no accelerator on
  the machine: full syncs, no reference copy kept, nothing probed;
* otherwise **what the run measures**: each sync's save + push (rank zero's clock), a *full*
  sync against a *delta*. After a full sync is measured, a keyframe and one delta probe it and
  the cheaper kind is kept; a delta that is not cheaper sends the run back to full syncs for 2,
  4, ... up to :data:`RECHECK_MAX` syncs before the next probe (a learning-rate schedule is
  noticed at a bounded cost), and any delta that costs more than the last full sync ends the
  deltas.

A run's first sync (in the trainer's dtype, paying first-touch costs) is not measured. Every rank
feeds the choice rank zero's times, so every rank picks the same kind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..checkpoint.space import is_tmpfs

RECHECK_MAX = 64  # at most this many full syncs between two probes of a delta


def host_memory_transport(directory: Path | str) -> str | None:
    """Why every byte of a sync moves through host memory (None: some may not): the
    checkpoint directory is a tmpfs and this machine has no accelerator, so the trainer's
    tensors and the colocated engine's weights are host memory too."""
    if _has_accelerator():
        return None
    if not is_tmpfs(Path(directory)):
        return None
    return (
        "host memory carries every byte (the files in a tmpfs, no accelerator): a delta reads "
        "every value to find what changed, which costs as much as a full sync's copy"
    )


def _has_accelerator() -> bool:
    """Whether this machine has an accelerator (vLLM puts a colocated engine there)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        return True
    return torch.cuda.is_available()


class DeltaChoice:
    """Whether a run with ``delta="auto"`` sends deltas, from where its bytes go and what it
    measured (see the module); one per run. ``host_memory``: why the transport is host memory
    alone (:func:`host_memory_transport` of the run's directory; None: measure). ``full_s`` /
    ``delta_s``: the last measured cost of each kind (None: not measured yet)."""

    def __init__(self, host_memory: str | None = None) -> None:
        self.host_memory = host_memory
        self.full_s: float | None = None
        self.delta_s: float | None = None
        self.deltas_win = False
        self.wait = 0  # full syncs still to measure before the next probe
        self.backoff = 1

    def wants_deltas(self) -> bool:
        """Whether the next syncs keep the reference copy and send deltas: deltas measured
        cheaper, or a probe is due (a full sync was measured, and the wait after a lost probe
        is over)."""
        if self.host_memory is not None:
            return False
        return self.deltas_win or (self.full_s is not None and self.wait <= 0)

    def measured(self, kind: str, based: bool, seconds: float) -> None:
        """What one sync cost (save + push): a delta (probe or not) decides; a full sync
        that kept no reference copy is the price to beat (a keyframe that refreshed the copy
        pays for the deltas after it, so it is no full sync's price)."""
        if kind == "delta":
            self.delta_s = seconds
            self.deltas_win = self.full_s is None or seconds < self.full_s
            if self.deltas_win:
                self.backoff = 1
            else:
                self.backoff = min(2 * self.backoff, RECHECK_MAX)
                self.wait = self.backoff
        elif not based:
            self.full_s = seconds
            self.wait -= 1

    def describe(self, mode: str, engine_accepts: bool, delta: bool) -> dict[str, Any]:
        """The record of one sync's choice: ``delta`` (the option), ``sent`` (``"delta"`` or
        ``"full"``), ``why`` and the measured costs it rests on."""
        out: dict[str, Any] = {
            "delta": mode,
            "sent": "delta" if delta else "full",
            "full_s": self.full_s,
            "delta_s": self.delta_s,
        }
        if mode != "auto":
            why = f"delta={mode!r}"
        elif not engine_accepts:
            why = "the engine reported no dtypes yet: it cannot apply a delta"
        elif self.host_memory is not None:
            why = self.host_memory
        elif self.deltas_win:
            why = f"a delta measured cheaper ({self.delta_s:.3f} s"
            why += f" against {self.full_s:.3f} s for a full sync)" if self.full_s else ")"
        elif self.full_s is None:
            why = "measuring a full sync first"
        elif self.wait <= 0:
            why = f"probing a delta against a full sync ({self.full_s:.3f} s)"
        else:
            assert self.delta_s is not None
            why = (
                f"a full sync measured cheaper ({self.full_s:.3f} s against {self.delta_s:.3f} "
                f"s for a delta); a delta is probed again in {self.wait} sync(s)"
            )
        out["why"] = why
        return out
