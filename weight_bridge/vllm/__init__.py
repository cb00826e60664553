"""vLLM integration: the ``weight_bridge`` weight-transfer backend, its plugin, and clients.

An engine started with ``weight_transfer_config={"backend": "weight_bridge"}`` (``LLM``,
``AsyncLLM`` or ``vllm serve``) takes updates through vLLM's own RL API, each a proven,
transactional direct reload (:mod:`~weight_bridge.vllm.worker.backend`). One client protocol
(:mod:`~weight_bridge.vllm.clients.bridge_client`) pushes into each way of running it
(:class:`~weight_bridge.LLMClient`, :class:`~weight_bridge.AsyncLLMClient`,
:class:`~weight_bridge.HTTPClient`), and each generates the same results
(:class:`~weight_bridge.Generation`, :mod:`~weight_bridge.vllm.generation`);
:class:`~weight_bridge.ColocatedEngine`, :class:`~weight_bridge.AsyncColocatedEngine` and
:class:`~weight_bridge.ServedEngine` are those clients plus an engine they start and own
(:func:`start_engine` picks one by name). Every use of vLLM's private internals, and every
patch of vLLM, is in :mod:`~weight_bridge.vllm.internals`. The engines and clients a user imports
are :mod:`weight_bridge`'s; this front has the checks and what picks a client by name, each
imported on first use: importing a client module needs no vLLM.

Limitations: docs/limitations.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names typed for mypy and IDEs; at run time imported on first use
    from .clients.bridge_client import EngineClient
    from .clients.by_name import ENGINE_MODES, client_for, connect, start_engine
    from .clients.checks import expected_fingerprints, weight_mismatches

__all__ = [
    "ENGINE_MODES",
    "EngineClient",
    "client_for",
    "connect",
    "expected_fingerprints",
    "start_engine",
    "weight_mismatches",
]

_WHERE = {
    "EngineClient": "clients.bridge_client",
    "connect": "clients.by_name",
    "start_engine": "clients.by_name",
    "client_for": "clients.by_name",
    "ENGINE_MODES": "clients.by_name",
    "expected_fingerprints": "clients.checks",
    "weight_mismatches": "clients.checks",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
