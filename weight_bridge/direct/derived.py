"""Derived state re-derived after a write: each written module's refresher, in order."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .errors import DirectReloadError
from .state import bridge_state

__all__ = ["refresh_derived_state"]


def refresh_derived_state(model: torch.nn.Module, modules: Iterable[str]) -> dict[str, str]:
    """Re-derive the state of ``modules`` from their written weights with their refreshers;
    module -> kind refreshed. A failure leaves the model undefined, naming the module."""
    state = bridge_state(model)
    live = dict(model.named_modules())
    done: dict[str, str] = {}
    for name in modules:
        refresher = state.refreshers[name]
        try:
            refresher.refresh(live[name])
        except Exception as exc:
            state.undefined = (
                f"refreshing the {refresher.kind} of {name} after the write failed: "
                f"{type(exc).__name__}: {exc}"
            )
            raise DirectReloadError(state.undefined) from exc
        done[name] = refresher.kind
    return done
