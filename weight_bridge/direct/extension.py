"""The two extension points of a direct reload, both structural protocols.

An engine integration plugs in what the plain-torch core cannot know:

* a :class:`Refresher` per module whose *derived state* (a packed copy of a weight, a prepacked
  expert layout) it knows how to re-derive after a write;
* a :class:`Reprocessor` that hands whole modules the core cannot write directly to the
  engine's own per-layer processing (vLLM's layerwise reload).

Implement them by defining the attributes and methods below (subclassing is allowed, not
required); the core only reads what is declared here.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Refresher(Protocol):
    """Derived state of one module that an integration re-derives after a write.

    ``kind`` names it in reports. ``explains``: the module attributes whose creation or change by
    post-load processing the refresher accounts for (the proof does not count them against the
    module). ``sources``: parameter name -> the tensor, in checkpoint layout, a write must target
    instead of the live parameter (kept by the refresher because processing transformed the
    live one; empty when the live parameter itself is the target). :meth:`refresh` re-derives
    the state in place, addresses unchanged. A refresher may also set ``concurrent = True``
    when its refresh touches only its own module and is safe to run alongside the others'
    on other threads (:mod:`.parallel`); by default refreshes run one after another.
    """

    kind: str
    explains: frozenset[str]
    sources: dict[str, torch.Tensor]

    def refresh(self, module: torch.nn.Module) -> None: ...


class Reprocessor(Protocol):
    """The engine's own per-layer path for modules a direct write cannot serve.

    :meth:`begin` is called with the module names before the checkpoint is loaded (the modules
    are prepared to receive their weights whole), :meth:`finish` after, to process them.
    """

    def begin(self, modules: list[str]) -> None: ...

    def finish(self) -> None: ...
