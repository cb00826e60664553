"""The adapter versions resident in a bridged engine's LoRA slots, as the engine core knows them.

An adapter push writes a new version into a slot under a fresh LoRA id
(:mod:`~weight_bridge.vllm.worker.adapter_writer`); which of the bridge's ids are still in a slot
is what the workers answer after the write, and the version of each is the label the push was
stamped with, so the table is rebuilt from those two at every successful update and never edited
elsewhere. A base update empties it: vLLM drops every adapter when base weights change.

Labels: the engine's label (``set_weight_version``, stamped on every output) names the *base*
weights; a request sampled with a resident version is labelled with that version in the front end
(:func:`~weight_bridge.vllm.internals.lora.labelling_adapter_tokens`). So an adapter push stamps no
engine label, and a ``finish_weight_update(weight_version=V)`` after it, where ``V`` is the version
just pushed (vLLM's own RL API passes it), relabels nothing (:func:`labelling_the_base`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import AdapterVersionError
from ..internals.engine_core import requests_with_lora
from ..internals.lora import adapter_name
from ..outcome import PushResult
from ..report import PushReport
from .state import core_state


def resident_after(table: dict[str, dict[str, Any]], report: PushReport) -> dict:
    """The resident versions after the successful update ``report``: those the workers still
    hold, and the one it wrote under its label; none after a base update."""
    landed = report.results[0].adapter if report.results else None
    if landed is None or report.version is None:
        return {}
    kept = set(landed["resident"])
    table = {v: entry for v, entry in table.items() if entry["id"] in kept}
    lora_id = int(landed["id"])
    path = report.checkpoint
    table[report.version] = {
        "id": lora_id,
        "name": adapter_name(report.version, lora_id),
        "path": path,
    }
    return table


def retiring_in_use(core: Any, results: list[PushResult]) -> str | None:
    """Why a prepared adapter push may not take the slot it would take (None: it may): a
    request the engine holds still computes with the version that would leave it. Written
    under it, that request would go on with other bits than its label says; refused by name,
    nothing written, until it finished."""
    retiring = (results[0].adapter or {}).get("retiring") if results else None
    if retiring is None:
        return None
    using = requests_with_lora(core, int(retiring))
    if not using:
        return None
    version = next((v for v, e in core_state(core).adapters.items() if e["id"] == retiring), None)
    return (
        f"adapter version {version!r} would leave its LoRA slot, but {using} request(s) in the "
        "engine still compute with it: push again once they finished (nothing was written)"
    )


def labelling_the_base(original: Callable[[Any, str], None]) -> Callable[[Any, str], None]:
    """``EngineCore.set_weight_version``: a label that names a resident adapter version does not
    relabel the base weights (a client finishing an adapter push with its version)."""

    def set_weight_version(self: Any, weight_version: str) -> None:
        if weight_version in core_state(self).adapters:
            return
        original(self, weight_version)

    return set_weight_version


def weight_bridge_adapters(self: Any) -> dict[str, dict[str, Any]]:
    """Engine-core utility: the resident adapter versions, ``{version: {"id", "name",
    "path"}}``, oldest first (what a client names a request's ``LoRARequest`` from)."""
    return dict(core_state(self).adapters)


#: what ``generate(..., version=BASE)`` names: the base weights, whatever adapter is resident
#: (over HTTP the served name ``NAME@base``)
BASE = "base"


def chosen_adapter(table: dict[str, dict[str, Any]], version: Any) -> dict[str, Any] | None:
    """The resident entry a request samples with: ``version``'s, else (None) the newest; None
    for :data:`BASE`, or where the engine holds no adapter version (the base weights sample).
    A version that is not resident is refused by name
    (:class:`~weight_bridge.vllm.errors.AdapterVersionError`)."""
    if str(version) == BASE:
        return None
    if version is None:
        return table[list(table)[-1]] if table else None
    entry = table.get(str(version))
    if entry is None:
        held = ", ".join(map(repr, table)) or "none"
        raise AdapterVersionError(
            f"adapter version {str(version)!r} is not resident in the engine's LoRA slots "
            f"(resident: {held}); nothing was generated"
        )
    return entry
