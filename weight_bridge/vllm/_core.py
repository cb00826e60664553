"""The few vLLM-private engine-core internals the bridge relies on (vLLM 0.32), in one place.

After an update the KV cache computed by the old weights must not be served to a request that
arrives afterwards. vLLM's own ``reset_prefix_cache`` does that only when no running request
holds a block; with requests in flight (paused with ``mode="keep"``, or running while the
update arrives between two steps) it refuses. :func:`forget_prefixes` then does the rest:

* every cached block (those held by running requests included) loses its hash, so no new
  request can hit it (``BlockPool._maybe_evict_cached_block``);
* every running request's *future* blocks get hashes no new request can compute (its block
  hasher ``Request._block_hasher`` is salted): they hold KV partly computed by the old weights.

What it touches, each private to vLLM and the first thing to check on a vLLM upgrade:
``EngineCore.scheduler``, ``Scheduler.running``, ``Scheduler.kv_cache_manager.coordinator
.single_type_managers[*].block_pool`` (``blocks``, ``_maybe_evict_cached_block``,
``cached_block_hashes_by_block``), ``Request._block_hasher`` and ``EngineCore._weight_version``.
"""

from __future__ import annotations

import hashlib
from typing import Any

__all__ = ["forget_prefixes", "served_version"]


def served_version(core: Any) -> str | None:
    """The weight version the engine core stamps on outputs (vLLM's own, set by
    ``finish_weight_update(weight_version=...)``)."""
    version = getattr(core, "_weight_version", None)
    return None if version is None else str(version)


def _salted(hasher: Any, salt: bytes) -> Any:
    def salted_hasher(request: Any) -> list:
        return [type(h)(hashlib.sha256(salt + h).digest()[: len(h)]) for h in hasher(request)]

    salted_hasher.weight_bridge_salted = True  # type: ignore[attr-defined]
    return salted_hasher


def forget_prefixes(core: Any, salt: str) -> str:
    """Make sure no request arriving from now on reuses KV computed before this call; how.

    Returns ``"reset"`` when vLLM's own reset could run (no block in use), else
    ``"forgotten"`` (see the module docstring).
    """
    if core.reset_prefix_cache():
        return "reset"
    scheduler = core.scheduler
    pools = {
        id(m.block_pool): m.block_pool
        for m in scheduler.kv_cache_manager.coordinator.single_type_managers
    }
    for pool in pools.values():
        extra = pool.cached_block_hashes_by_block
        for block in pool.blocks:
            if block.block_hash is not None or block.block_id in extra:
                pool._maybe_evict_cached_block(block)
    seed = salt.encode()
    for request in scheduler.running:
        hasher = getattr(request, "_block_hasher", None)
        if hasher is not None:
            request._block_hasher = _salted(hasher, seed)
    return "forgotten"
