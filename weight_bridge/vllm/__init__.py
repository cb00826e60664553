"""vLLM integration: the ``weight_bridge`` weight-transfer backend, its plugin, and clients.

An engine started with ``weight_transfer_config={"backend": "weight_bridge"}`` (``LLM``,
``AsyncLLM`` or ``vllm serve``) takes updates through vLLM's own RL API, each a proven,
transactional direct reload (:mod:`~weight_bridge.vllm.worker.backend`). One client protocol
(:mod:`~weight_bridge.vllm.clients.bridge_client`) pushes into each way of running it
(:class:`LLMClient`, :class:`AsyncLLMClient`, :class:`HTTPClient`), and each generates the same
results (:class:`Generation`, :mod:`~weight_bridge.vllm.generation`); :class:`ColocatedEngine`,
:class:`AsyncColocatedEngine` and :class:`ServedEngine` are those clients plus an engine they start
and own (:func:`start_engine` picks one by name). Every use of vLLM's private internals, and every
patch of vLLM, is in :mod:`~weight_bridge.vllm.internals`. The engines and clients a user imports
are :mod:`weight_bridge`'s; this front has the checks and what picks a client by name, each
imported on first use: importing a client module needs no vLLM.

Limitations:
1. Only vLLM's default safetensors loader is bridged (the checkpoint is captured as it loads).
2. Derived state is refreshed for the CPU backend's packed linears and its unquantized MoE
   experts prepack; other derived state or transformed weights are re-processed by vLLM's
   layerwise path (``auto``, for modules whose own processing made the change) or refused.
3. Kernel objects created by processing on modules that hold no weight (e.g. a MoE kernel
   built from the configuration) are taken as not holding weight values; a kernel that copied
   weights into one would be missed by the proof (the callback's canary would catch it).
4. Each worker reads the checkpoint from a path it can open, under the engine's checkpoint
   root: colocated means same filesystem.
5. With vLLM's asynchronous scheduling (a batch queue; off on the CPU backend, on by default on
   GPUs) a step already queued when an update commits would have its output stamped with the
   new version; the bridge stamps at commit assuming steps run one at a time (not run here).
6. An engine left undefined (a rollback that failed too) stops scheduling; a plain ``vllm.LLM``
   caller's ``generate`` then waits until a complete update succeeds (``LLMClient`` and
   ``ColocatedEngine`` refuse instead).
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
