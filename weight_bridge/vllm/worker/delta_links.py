"""A worker's deltas: planning one, what the engine reports a trainer may diff against, and the
fingerprints of what it serves.

Why here: the transaction (:mod:`.transaction`) treats a delta as one more kind of link in its
served chain; what is specific to deltas (which reload modes can apply one, which dtypes the
trainer must cast to, which fingerprints become the next delta's base) lives in this module.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ...delta.format import lineage_of, read_delta, split_name
from ...direct import DirectReloadError
from ...direct.delta import prepare_delta
from ...direct.state import bridge_state
from ...direct.writer import Writer
from ..internals.model import quantized_layers
from ..options import BridgeOptions

DELTA_MODES = ("direct", "auto")  # the modes whose complete pushes learn a write map


def plan_delta(
    model: torch.nn.Module,
    options: BridgeOptions,
    path: str,
    metadata: Mapping[str, str],
    items: list[tuple[str, torch.Tensor]],
    finite: bool,
) -> Writer:
    """Decode and check the delta at ``path`` and map it onto this worker's storages; a
    refusal raises with nothing written."""
    mode = options.reload_mode
    if mode not in DELTA_MODES:
        raise DirectReloadError(
            f"a delta is applied by the bridge's direct writer, and this engine pushes in "
            f"{mode!r} mode: push complete checkpoints (nothing was written)"
        )
    delta = read_delta(path, metadata, dict(items))
    return prepare_delta(model, delta, check_finite=finite, readback=options.readback)


def served_dtypes(model: torch.nn.Module) -> dict[str, str]:
    """After a complete push: checkpoint name -> the dtype the engine holds it in, for every
    tensor a delta can patch (empty where no write map was learned, or where the engine holds
    quantized layers: deltas are refused, and a trainer's ``delta="auto"`` sends full syncs)."""
    write_map = bridge_state(model).write_map
    if write_map is None or quantized_layers(model):
        return {}
    return {n: str(d).removeprefix("torch.") for n, d in sorted(write_map.dtypes.items())}


def link_fingerprints(
    model: torch.nn.Module, recorded: Mapping[str, int], delta: bool, items: list, partial: bool
) -> None:
    """After a link was written: the served fingerprints it records (``recorded``: its
    header's, parsed at prepare:
    :func:`~weight_bridge.delta.format.header_fingerprints`) become the base of the next
    delta. A complete checkpoint replaces them all (a trainer's keyframe records every
    tensor's; a file without them leaves none known, and the first delta computes them from
    live storage); a partial one replaces those of its tensors. A delta updated its own."""
    state = bridge_state(model)
    if delta:
        return
    if not partial:
        state.fingerprints = {}
    for key, _ in items:
        name, _part = split_name(key)
        state.fingerprints.pop(name, None)
        if name in recorded:
            state.fingerprints[name] = recorded[name]


def link_lineage(prints: Mapping[str, int], partial: bool, below: str | None) -> str | None:
    """The lineage (:func:`~weight_bridge.delta.format.lineage_of`) of what the engine
    serves once this checkpoint (``prints``: its recorded fingerprints) is written on top of
    weights of lineage ``below``: a fingerprinted complete one starts a lineage, a
    fingerprinted one on top extends a known one; anything else leaves none (nothing can be
    proven to apply on top of it)."""
    if not prints:
        return None
    if not partial:
        return lineage_of(None, prints)
    return lineage_of(below, prints) if below is not None else None
