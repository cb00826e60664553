"""vLLM's own sparse patches applied inside the engine's worker, for the "delta sync" section.

vLLM 0.32 ships ``load_checkpoint_weight_patches`` (``vllm/model_executor/model_loader/
checkpoint_weight_patch.py``; what its ``sparse_nccl`` weight-transfer backend calls on each
worker): each sparse patch is staged as a full-size tensor of NaNs with the changed values
scattered in, then handed to the model's own ``load_weights`` while ``Tensor.copy_`` is swapped
for a "keep the destination where the source is NaN" ``torch.where`` over the whole tensor.
Only loaders that end in one same-shaped ``copy_`` are supported, and nothing is rolled back.

The methods below apply one delta file that way on the live model of a *bridged* engine (vLLM's
own CPU engine empties its linear weights into oneDNN handles, so it holds nothing to patch; the
bridged engine keeps them, and its refreshers re-pack what was written, as after the bridge's
own push), called by name through ``collective_rpc`` in this order:

1. :meth:`~DeltaWorkerMixin.bench_vllm_snapshot`: a copy of every parameter (untimed);
2. :meth:`~DeltaWorkerMixin.bench_vllm_patch`: read and decode the delta, vLLM's patches, then
   the re-pack of the modules written (the bridge's refreshers, the modules the bridge's own
   rule picks): the timed part;
3. :meth:`~DeltaWorkerMixin.bench_vllm_check`: the exact fingerprint (:mod:`weight_bridge.exact`)
   of every tensor the delta touches, read from live storage, against the one the trainer
   recorded in the delta, and every other parameter unchanged;
4. :meth:`~DeltaWorkerMixin.bench_vllm_restore`: the snapshot put back and re-packed, so the
   bridge's own push of the same delta then runs on the same base.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

__all__ = ["DeltaWorkerMixin"]


def _patches(path: str) -> tuple[list, list, dict[str, int]]:
    """The delta at ``path`` as vLLM's ``CheckpointWeightPatch`` lists (dense, sparse) and the
    fingerprints it records, decoded by the format's own reader."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import CheckpointWeightPatch

    from weight_bridge.checkpoint import CheckpointReader
    from weight_bridge.checkpoint.delta import read_delta

    with CheckpointReader(path) as reader:
        metadata = dict(reader.metadata)
        tensors = {n: t.clone() for n, t in reader.tensors()}
    delta = read_delta(path, metadata, tensors)
    dense = [
        CheckpointWeightPatch(n, tuple(t.shape), t.dtype, t.reshape(-1)) for n, t in delta.dense
    ]
    sparse = [
        CheckpointWeightPatch(n, s.shape, s.values.dtype, s.values, s.indices)
        for n, s in delta.sparse.items()
    ]
    return dense, sparse, dict(delta.fingerprints)


def _same(a: Any, b: Any) -> bool:
    """Bit for bit."""
    import torch

    from weight_bridge.exact import bits_of

    return torch.equal(bits_of(a.detach()), bits_of(b.detach()))


def _refreshed(model: Any, names: list[str]) -> dict[str, str]:
    """The modules whose derived state the bridge refreshes after writing ``names`` (its own
    rule: :func:`weight_bridge.direct.delta._refresh_of`)."""
    from weight_bridge.direct.delta import _refresh_of
    from weight_bridge.direct.snapshot import addresses
    from weight_bridge.direct.state import bridge_state

    write_map = bridge_state(model).write_map
    assert write_map is not None, "push a complete checkpoint first"
    problems: dict[str, str] = {}
    patches = [SimpleNamespace(name=n) for n in names]
    refresh = _refresh_of(model, patches, write_map, problems, addresses(model))  # type: ignore[arg-type]
    if problems:
        raise RuntimeError(f"no refresh after vLLM's patches: {problems}")
    return refresh


class DeltaWorkerMixin:
    """Worker methods (``self`` is vLLM's worker), called by name through ``collective_rpc``."""

    model_runner: Any  # vLLM's worker's
    _bench_snapshot: dict | None = None
    _bench_refresh: dict | None = None

    def bench_vllm_snapshot(self) -> int:
        """Keep a copy of every parameter (what :meth:`bench_vllm_restore` puts back); bytes."""
        params = self.model_runner.get_model().named_parameters()
        self._bench_snapshot = {n: p.detach().clone() for n, p in params}
        return sum(t.nbytes for t in self._bench_snapshot.values())

    def bench_vllm_patch(self, path: str) -> dict[str, Any]:
        """The delta at ``path`` by vLLM's ``load_checkpoint_weight_patches`` (one call for its
        dense tensors, one for its sparse ones: vLLM takes one kind per call), then the re-pack
        of the modules written. Seconds: ``decode_s`` (read the file, decode), ``apply_s``
        (vLLM's patches), ``refresh_s`` (the re-pack)."""
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (
            load_checkpoint_weight_patches,
        )

        from weight_bridge.direct.derived import refresh_derived_state

        model = self.model_runner.get_model()
        t0 = time.perf_counter()
        dense, sparse, _ = _patches(path)
        t1 = time.perf_counter()
        for group in (dense, sparse):
            if group:
                load_checkpoint_weight_patches(model, group)
        t2 = time.perf_counter()
        self._bench_refresh = _refreshed(model, [p.name for p in dense + sparse])
        refresh_derived_state(model, self._bench_refresh)
        t3 = time.perf_counter()
        changed = sum(p.values.numel() for p in dense + sparse)
        return {
            "decode_s": t1 - t0,
            "apply_s": t2 - t1,
            "refresh_s": t3 - t2,
            "tensors": len(dense) + len(sparse),
            "dense": len(dense),
            "changed": changed,
        }

    def bench_vllm_check(self, path: str) -> dict[str, Any]:
        """What vLLM's patches left: each touched tensor's exact fingerprint (live storage)
        against the trainer's (recorded in the delta), and parameters written outside it."""
        from weight_bridge.direct.state import bridge_state
        from weight_bridge.direct.write_map import held_tensor
        from weight_bridge.exact import exact_fingerprint, format_fingerprint

        model = self.model_runner.get_model()
        snapshot = self._bench_snapshot
        assert snapshot is not None, "bench_vllm_snapshot first"
        dense, sparse, wanted = _patches(path)
        write_map = bridge_state(model).write_map
        assert write_map is not None
        held: dict[str, str] = {}
        wrong: dict[str, str] = {}
        for patch in dense + sparse:
            got = exact_fingerprint(held_tensor(write_map, patch.name, patch.shape))
            held[patch.name] = format_fingerprint(got)
            if got != wanted[patch.name]:
                wrong[patch.name] = f"{got:016x}, the trainer's {wanted[patch.name]:016x}"
        touched = {p for n in held for p in write_map.params.get(n, set())}
        params = dict(model.named_parameters())
        elsewhere = [n for n, p in params.items() if n not in touched and not _same(p, snapshot[n])]
        return {
            "fingerprints": held,
            "differs_from_trainer": wrong,
            "written_outside_the_delta": elsewhere,
            "equals_trainer": not wrong and not elsewhere,
        }

    def bench_vllm_restore(self) -> bool:
        """Put back the snapshot and re-derive what was refreshed; whether every parameter
        holds its snapshot's bits again."""
        import torch

        from weight_bridge.direct.derived import refresh_derived_state

        model = self.model_runner.get_model()
        snapshot, self._bench_snapshot = self._bench_snapshot, None
        assert snapshot is not None, "bench_vllm_snapshot first"
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, saved in snapshot.items():
                params[name].copy_(saved)
        refresh_derived_state(model, self._bench_refresh or {})
        return all(_same(params[n], saved) for n, saved in snapshot.items())
