"""A CPU worker started by vLLM's external launcher (an engine in the trainer's ranks): its
shared-memory communicators named by the job, not by a constant.

Why: vLLM's CPU worker names the shared-memory segments of its tensor-parallel groups after
``VLLM_DIST_IDENT``, which it sets just before initialising its distributed state to the port of
its init method. The external launcher's init method is ``env://``, whose "port" is ``//``: every
such engine on a machine got the same names, and a second job's engine (two RL runs on one
machine; two test jobs at once) failed to start with ``create shm in SHMManager failed. errno:
17``. Named by the job's rendezvous port (``MASTER_PORT``: one per running job on a host, the
same on every rank of a job), each job's groups are its own.
"""

from __future__ import annotations

import os
from typing import Any

_ENV_IDENT = "//"  # what vLLM derives from "env://"


def naming_shm_by_job(init: Any) -> Any:
    """``init_worker_distributed_environment`` of vLLM's CPU worker, with ``VLLM_DIST_IDENT``
    made the job's where the external launcher left the constant."""

    def init_worker_distributed_environment(*args: Any, **kwargs: Any) -> Any:
        if os.environ.get("VLLM_DIST_IDENT") == _ENV_IDENT and os.environ.get("MASTER_PORT"):
            os.environ["VLLM_DIST_IDENT"] = f"job{os.environ['MASTER_PORT']}"
        return init(*args, **kwargs)

    return init_worker_distributed_environment
