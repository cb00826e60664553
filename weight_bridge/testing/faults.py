"""FAULT INJECTION for engines a test cannot reach into: a ``vllm serve`` process, whose workers
take no function over HTTP (vLLM's development route calls worker methods by name only).

Started with ``WEIGHT_BRIDGE_PLUGINS=weight_bridge.testing.faults:register`` and
``WEIGHT_BRIDGE_TEST_FAULT_FILE=PATH``, every engine process refreshes derived state through a
wrapper that raises while ``PATH`` exists: a push then fails after it wrote (in the refresh, the
last step of a direct write), as a refresher that breaks would make it. A file that reads
``once`` is removed as the fault fires, so the rollback that follows refreshes as usual. Nothing
else changes.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

__all__ = ["FAULT_FILE_ENV", "FAULTS", "register"]

FAULT_FILE_ENV = "WEIGHT_BRIDGE_TEST_FAULT_FILE"
FAULTS = "weight_bridge.testing.faults:register"


def register() -> None:
    """Wrap the direct session's refresh of derived state (a vLLM plugin function)."""
    path = os.environ.get(FAULT_FILE_ENV)
    if not path:
        return
    from ..direct import session

    refresh = session.refresh_derived_state
    if getattr(refresh, "fault_file", None) == path:
        return  # wrapped already in this process

    def refresh_unless_armed(*args: Any, **kwargs: Any) -> Any:
        if os.path.exists(path):
            if _reads(path) == "once":  # disarmed as it fires: the rollback's refresh works
                with contextlib.suppress(OSError):
                    os.unlink(path)
            raise RuntimeError(f"injected fault: {path} exists")
        return refresh(*args, **kwargs)

    refresh_unless_armed.fault_file = path  # type: ignore[attr-defined]
    session.refresh_derived_state = refresh_unless_armed


def _reads(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""
