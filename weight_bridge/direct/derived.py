"""Derived state re-derived after a write: each written module's refresher.

Refreshers that declare ``concurrent = True`` (their refresh touches only their own module
and spends its time in a kernel that releases the GIL, like the CPU backend's oneDNN re-pack)
run split across the push's threads (:mod:`.parallel`); the others run one after another on
the calling thread, after them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .errors import DirectReloadError
from .parallel import run_split
from .state import bridge_state


def _cost(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))


def refresh_derived_state(model: torch.nn.Module, modules: Iterable[str]) -> dict[str, str]:
    """Re-derive the state of ``modules`` from their written weights with their refreshers;
    module -> kind refreshed. A failure leaves the model undefined, naming the module (the
    first in ``modules`` order that failed)."""
    state = bridge_state(model)
    live = dict(model.named_modules())
    names = list(modules)
    together = [n for n in names if getattr(state.refreshers[n], "concurrent", False)]
    concurrent = set(together)
    alone = [n for n in names if n not in concurrent]

    def refresh(name: str) -> None:
        state.refreshers[name].refresh(live[name])

    split = run_split(together, lambda n: _cost(live[n]), refresh)
    outcome: dict[str, object] = dict(zip(together, split, strict=True))
    for name in alone:
        try:
            refresh(name)
        except Exception as failed:
            outcome[name] = failed
            break
    for name in names:
        error = outcome.get(name)
        if isinstance(error, BaseException):
            if not isinstance(error, Exception):
                raise error  # an interrupt, not an outcome of the refresh
            kind = state.refreshers[name].kind
            state.undefined = (
                f"refreshing the {kind} of {name} after the write failed: "
                f"{type(error).__name__}: {error}"
            )
            raise DirectReloadError(state.undefined) from error
    return {name: state.refreshers[name].kind for name in names}
