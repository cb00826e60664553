"""An engine core process that outlives the process which started it ends itself.

vLLM's workers watch their engine core, but the engine core does not watch the process that
started it: when that process is killed (``SIGKILL``, the OOM killer, Lightning ending every
rank of a DDP job after one failed), the engine core and its workers live on with the model
and the KV cache in memory, serving nobody, and keep the job's output pipes open.

:class:`~weight_bridge.ColocatedEngine` names its own process in :data:`FRONTEND_ENV`
while vLLM starts the engine processes (they inherit the environment). In each process vLLM
starts, the plugin calls :func:`follow_parent`: a direct child of that process (the engine
core, or a worker of an in-process engine) watches it and, once it is gone, sends itself
``SIGTERM``, which vLLM handles by shutting the engine down with its workers, then exits
outright if that did not end it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

FRONTEND_ENV = "WEIGHT_BRIDGE_FRONTEND_PID"
POLL_S = 1.0  # how often the parent is looked for
GRACE_S = 15.0  # how long vLLM's own shutdown may take before the process exits outright

_logger = logging.getLogger(__name__)
_following = False


def follow_parent() -> bool:
    """Start watching the parent if this process is a direct child of a bridge's process;
    whether it was started (once per process)."""
    global _following
    parent = os.environ.get(FRONTEND_ENV, "")
    if _following or not parent.isdigit() or int(parent) != os.getppid():
        return False
    _following = True
    threading.Thread(
        target=_watch, args=(int(parent),), name="weight-bridge-lifeline", daemon=True
    ).start()
    return True


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    _logger.warning(
        "weight_bridge: the process that started this vLLM engine (pid %d) is gone; "
        "shutting the engine down",
        parent,
    )
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    os._exit(1)
