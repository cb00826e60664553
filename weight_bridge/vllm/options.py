"""The bridge's options for one vLLM engine, shared by the plugin, the refreshers and the backend.

An engine is *bridged* when it is started with vLLM's weight-transfer config naming the
bridge's backend (``weight_transfer_config={"backend": "weight_bridge"}``, CLI
``--weight-transfer-config '{"backend": "weight_bridge"}'``). Its options come from
``additional_config={"weight_bridge": {...}}`` (CLI ``--additional-config``), fixed when the
engine starts; :meth:`BridgeOptions.from_config` reads and checks them. Per-update choices a
trainer may make (read-back, NaN/Inf check, hash check) can also be given in
``init_weight_transfer_engine``'s ``init_info``; the checkpoint root never can.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

from ..direct.readback import READBACK_MODES

BACKEND = "weight_bridge"  # the backend's name in vLLM's factories, and its additional_config key
# the method name the engine core routes to the backend's read-only queries (any client sends it)
BACKEND_RPC = "weight_bridge.call_backend"
ROOT_ENV = "WEIGHT_BRIDGE_CHECKPOINT_ROOT"  # the default checkpoint root of the bridge's engines
# what init_weight_transfer_engine's init_info may change for a running engine
SESSION_FIELDS = ("reload_mode", "readback", "check_finite", "verify_hash", "rollback")
CPU_LINEAR_MODES = ("torch", "repack", "stock")
RELOAD_MODES = ("direct", "layerwise", "auto", "vllm-direct")
ReloadMode = Literal["direct", "layerwise", "auto", "vllm-direct"]


@dataclass(frozen=True)
class BridgeOptions:
    """What a bridged engine does on an update.

    ``checkpoint_root``: the only directory updates may read checkpoints from (see
    :mod:`weight_bridge.checkpoint.trust`); unset, every update is refused with how to set it.
    ``reload_mode``: ``direct`` (refuse what cannot be proven), ``auto`` (hand unprovable
    modules to vLLM's layerwise processing), ``layerwise`` (always vLLM's own reload) or
    ``vllm-direct`` (vLLM 0.34+: vLLM's own direct reload writes, the bridge checks, reads back
    and rolls back; :mod:`~weight_bridge.vllm.worker.vllm_direct`).
    ``cpu_linear`` (CPU backend): see :mod:`weight_bridge.vllm.worker.refresh`. ``readback``:
    ``sampled``, ``full`` or ``off``. ``check_finite``: refuse NaN/Inf. ``verify_hash``: check
    the content hash :func:`~weight_bridge.checkpoint.save_checkpoint` writes. ``rollback``:
    re-write the served version after an update that failed mid-write (else the engine is left
    undefined and refuses to generate). ``update_timeout_s``: an update that makes no call
    for this long (a trainer that died between ``start_weight_update`` and
    ``finish_weight_update``) is abandoned by the next ``start_weight_update``; until then a
    second start is refused (:class:`~weight_bridge.vllm.errors.UpdateInProgressError`).
    """

    checkpoint_root: str | None = None
    reload_mode: ReloadMode = "direct"
    cpu_linear: str = "repack"
    readback: str = "sampled"
    check_finite: bool = True
    verify_hash: bool = False
    rollback: bool = True
    update_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.reload_mode not in RELOAD_MODES:
            raise ValueError(f"reload_mode must be one of {RELOAD_MODES}, not {self.reload_mode!r}")
        if self.cpu_linear not in CPU_LINEAR_MODES:
            raise ValueError(
                f"cpu_linear must be one of {CPU_LINEAR_MODES}, not {self.cpu_linear!r}"
            )
        if self.readback not in READBACK_MODES:
            raise ValueError(f"readback must be one of {READBACK_MODES}, not {self.readback!r}")
        if not self.update_timeout_s > 0:
            raise ValueError(f"update_timeout_s must be > 0, not {self.update_timeout_s!r}")
        if self.checkpoint_root is not None and not os.path.isabs(self.checkpoint_root):
            object.__setattr__(self, "checkpoint_root", os.path.abspath(self.checkpoint_root))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BridgeOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown weight_bridge options {unknown}; known: {sorted(known)}")
        return cls(**data)

    def with_session(self, init_info: dict[str, Any]) -> BridgeOptions:
        """These options with a trainer's per-session choices applied (:data:`SESSION_FIELDS`
        only: the checkpoint root, the CPU linear mode and the update timeout are fixed when
        the engine starts)."""
        fixed = sorted(set(init_info) - set(SESSION_FIELDS))
        if fixed:
            raise ValueError(
                f"init_info may set {list(SESSION_FIELDS)}; {fixed} are fixed when the engine "
                "starts (additional_config or --additional-config), never by a request"
            )
        return replace(self, **init_info)

    @classmethod
    def split(cls, kwargs: dict[str, Any]) -> tuple[BridgeOptions, dict[str, Any]]:
        """The options named in ``kwargs`` (an engine's keywords, flat as a YAML config gives
        them), and the rest (vLLM's); the checkpoint root defaults to
        ``$WEIGHT_BRIDGE_CHECKPOINT_ROOT``, else the current directory."""
        names = {f.name for f in fields(cls)}
        chosen = {k: v for k, v in kwargs.items() if k in names}
        root = chosen.get("checkpoint_root") or os.environ.get(ROOT_ENV) or os.getcwd()
        chosen["checkpoint_root"] = str(Path(root).resolve())
        return cls(**chosen), {k: v for k, v in kwargs.items() if k not in names}

    def as_config(self) -> dict[str, Any]:
        """The ``additional_config`` entry that starts an engine with these options."""
        return {BACKEND: asdict(self)}


def is_bridged(vllm_config: Any) -> bool:
    """Whether the engine runs the bridge's weight-transfer backend."""
    transfer = getattr(vllm_config, "weight_transfer_config", None)
    return getattr(transfer, "backend", None) == BACKEND


def bridge_options(vllm_config: Any = None) -> BridgeOptions | None:
    """The bridge's options of the engine being built or run here, or None if not bridged.

    ``vllm_config`` defaults to the one vLLM is building or running in this process.
    """
    if vllm_config is None:
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None or not is_bridged(vllm_config):
        return None
    extra = getattr(vllm_config, "additional_config", None) or {}
    raw = extra.get(BACKEND) if isinstance(extra, dict) else None
    return BridgeOptions.from_dict(dict(raw or {}))
