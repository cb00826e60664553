"""Delta checkpoints written as a trainer writes them, and what applying one costs in memory.

Shared by the tests (:mod:`tests.test_delta`: this process's resident memory on the CPU) and the
GPU check (``tools/gpu_check.py --delta-memory``: ``torch.cuda.max_memory_allocated``), so that
the bound the project states, *applying a delta peaks within twice its largest tensor plus its
undo log*, is measured the same way on the device that pays for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint import save_checkpoint
from ..delta.format import changed_indices, delta_metadata, stored_parts
from ..exact import bits_of, exact_fingerprint

ROWS, COLS = 4096, 8192  # one 64 MiB bf16 tensor


def delta_checkpoint(
    old: dict, new: dict, base: str, version: str, path: Path, dense: set | None = None
) -> Path:
    """A delta from ``old`` to ``new`` (name -> tensor, same dtypes) on top of version
    ``base``: each changed tensor sparse or dense, whichever is smaller (``dense``: names
    always dense, as a trainer sends those the engine cannot patch), fingerprinted."""
    tensors: dict = {}
    shapes: dict = {}
    prints: dict = {}
    for name in old:
        changed = changed_indices(old[name], new[name])
        if not changed.numel():
            continue
        parts = stored_parts(name, new[name], changed)
        if name in (dense or ()):
            parts = {name: new[name]}
        if name not in parts:
            shapes[name] = list(new[name].shape)
        tensors.update(parts)
        prints[name] = exact_fingerprint(new[name])
    save_checkpoint(tensors, path, delta_metadata(base, version, prints, shapes))
    return path


class Wide(torch.nn.Module):
    """One large bf16 weight, copied in by its loader: whole, or (``held`` columns) the first
    columns only, as a tensor-parallel rank holds a row-parallel layer's shard (its elements
    are not one run of the checkpoint's: solved coordinate by coordinate)."""

    def __init__(
        self, rows: int, cols: int, device: str | torch.device = "cpu", held: int | None = None
    ) -> None:
        super().__init__()
        self.held = held or cols
        shape = (rows, self.held)
        self.w = torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16, device=device))

    def load_weights(self, weights) -> set[str]:
        for _, t in weights:
            self.w.data.copy_(t[:, : self.held])
        return {"w"}


def wide_pair(fraction: float) -> tuple[dict, dict]:
    """A 64 MiB bf16 tensor (on the CPU, as a trainer's cast) and the next one, ``fraction`` of
    its elements changed (1: every one)."""
    g = torch.Generator().manual_seed(0)
    a = {"w": torch.randn(ROWS, COLS, generator=g).to(torch.bfloat16)}
    new = (a["w"].float() * 1.01 + 0.003).to(torch.bfloat16)
    if fraction < 1:
        new = torch.where(torch.rand(ROWS, COLS, generator=g) < fraction, new, a["w"])
    return a, {"w": new}


@dataclass
class AppliedMemory:
    """A delta applied to a :class:`Wide` engine: ``peak``, the most memory it took beyond
    what was in use before (bytes, on the engine's device); ``undo``, its undo log's bytes."""

    model: Wide
    peak: int
    undo: int

    @property
    def bound(self) -> int:
        """Twice the tensor plus the undo log: what the project states a delta peaks within."""
        return 2 * ROWS * COLS * 2 + self.undo


def _status_bytes(key: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key))
    return int(line.split()[1]) * 1024


def applied_memory(
    a: dict, delta, device: str | torch.device = "cpu", held: int | None = None
) -> AppliedMemory:
    """An engine-like :class:`Wide` on ``a`` on ``device`` (``held``: its columns, for a
    shard), then ``delta`` (decoded by
    :func:`~weight_bridge.delta.format.read_delta`) prepared and applied, measured: on CUDA
    ``torch.cuda.max_memory_allocated`` over what was allocated before; elsewhere this
    process's resident high-water mark over what was resident before (``/proc``, reset
    first), the delta file's pages read in before (they are the transport's, not the
    apply's). The undo log is then undone and checked against ``a``."""
    from ..direct import direct_reload, record_checkpoint_layout
    from ..direct.delta import prepare_delta
    from ..direct.state import bridge_state
    from ..layout import TensorSpec

    device = torch.device(device)
    m = Wide(ROWS, COLS, device, held)
    with torch.no_grad():
        m.load_weights(a.items())
    record_checkpoint_layout(m, checkpoint={"w": TensorSpec((ROWS, COLS), torch.bfloat16)})
    direct_reload(m, a)
    bridge_state(m).fingerprints = {"w": exact_fingerprint(a["w"])}
    for t in [t for _, t in delta.dense] + [sp.values for sp in delta.sparse.values()]:
        bits_of(t.reshape(-1)).sum(dtype=torch.int64)  # the file's pages read in: not the apply's
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        before = _status_bytes("VmRSS:")
        Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts here
    prepared = prepare_delta(m, delta)
    prepared.run()
    if cuda:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    else:
        peak = _status_bytes("VmHWM:") - before
    assert prepared.undo_log is not None
    applied = m.w.detach().clone()
    prepared.undo_log.undo(m)
    want = a["w"][:, : m.held]
    assert torch.equal(m.w.detach().cpu().view(torch.int16), want.view(torch.int16))
    m.w.data.copy_(applied)
    return AppliedMemory(m, peak, prepared.undo_log.nbytes)
