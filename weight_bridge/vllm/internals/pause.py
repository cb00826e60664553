"""How the bridge pauses an ``AsyncLLM`` so that requests arriving meanwhile wait (site 19 of
the checklist in :mod:`weight_bridge.vllm.internals`).

``AsyncLLM.pause_generation(mode="wait")`` is the public way to let running requests finish
before an update. In vLLM 0.32 it only called the engine core's ``pause_scheduler`` utility:
new requests were queued until ``resume_generation``. From 0.33 it calls the engine core's
``pause_generation`` utility instead, which is ``pause_scheduler`` *plus* a rejection of every
new request (``RetryableRequestError``, HTTP 503) until resume: a caller generating while a
``drain`` push runs would see its request fail. ``pause_scheduler`` is still there in 0.34 and
still queues (``PauseState.PAUSED_NEW``: running requests keep stepping, queued ones are not
scheduled), and ``resume_scheduler`` (what ``resume_generation`` calls) releases them. So the
bridge calls it directly, on every tested vLLM: one path, 0.32's behaviour on both.

:func:`release_pause` ends such a pause that nobody else ended (the API server's release of a
pause no update followed): ``AsyncLLM.is_paused()`` and ``resume_generation()``, public on every
tested vLLM.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

# AsyncLLM.pause_generation sleeps this long after the engine core answered, so that the final
# outputs of the requests that drained reach their callers before the pause returns.
_SETTLE_S = 0.02


async def pause_queueing(engine: Any, mode: str, clear_cache: bool) -> None:
    """Pause an ``AsyncLLM``'s scheduler like ``pause_generation(mode, clear_cache)`` does,
    but with requests that arrive during the pause queued, never rejected. ``mode="wait"``
    returns once the running requests finished. The caller resumes with
    ``engine.resume_generation()``."""
    await engine.engine_core.pause_scheduler_async(mode=mode, clear_cache=clear_cache)
    await asyncio.sleep(_SETTLE_S)


async def release_pause(engine: Any, still_ours: Callable[[], bool]) -> bool:
    """Resume an ``AsyncLLM``'s generation if it is paused and ``still_ours()`` (checked last,
    after the engine answered); whether it did."""
    if not await engine.is_paused() or not still_ours():
        return False
    await engine.resume_generation()
    return True
