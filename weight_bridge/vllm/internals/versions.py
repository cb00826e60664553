"""Which vLLMs the bridge is tested with, and the refusal of any other.

The bridge patches and reads vLLM internals (the checklist in :mod:`weight_bridge.vllm.internals`)
that change between minor versions without notice; 0.33 changed ``WeightSource`` and the pause,
0.34 moved the GPU model runner and added vLLM's own direct reload. Running on a minor version
nobody went through the checklist for could write weights where generation does not read them,
so an untested minor version is refused, not warned about. :data:`ALLOW_UNTESTED_ENV` set to
``1`` lets one through (with a warning), for whoever is going through the checklist.
"""

from __future__ import annotations

import logging
import os
import re

from ...errors import WeightBridgeError

#: The minor versions the whole suite (0.32) and the ``every_vllm`` subset (0.34) pass on.
TESTED_VLLM = ("0.32", "0.34")
CHECKLIST = "weight_bridge/vllm/internals/__init__.py"
ALLOW_UNTESTED_ENV = "WEIGHT_BRIDGE_ALLOW_UNTESTED_VLLM"

_logger = logging.getLogger(__name__)


class UntestedVLLMError(WeightBridgeError, RuntimeError):
    """The installed vLLM is a minor version the bridge was not tested with."""


def installed_vllm() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def vllm_minor(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of ``version`` (default: the installed vLLM); (0, 0) if unreadable."""
    found = re.match(r"(\d+)\.(\d+)", version or installed_vllm())
    return (int(found[1]), int(found[2])) if found else (0, 0)


def check_vllm_version() -> str:
    """The installed vLLM's version if it is a tested minor version; else
    :class:`UntestedVLLMError` naming the checklist and the opt-in, or, with the opt-in set, one
    warning."""
    installed = installed_vllm()
    major, minor = vllm_minor(installed)
    if f"{major}.{minor}" in TESTED_VLLM:
        return installed
    message = (
        f"weight-bridge is tested with vLLM {' and '.join(TESTED_VLLM)}, this is vLLM "
        f"{installed}: go through the upgrade checklist in {CHECKLIST}"
    )
    if os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        raise UntestedVLLMError(f"{message}, or set {ALLOW_UNTESTED_ENV}=1 to run on it anyway")
    _logger.warning("%s (running anyway: %s=1)", message, ALLOW_UNTESTED_ENV)
    return installed
