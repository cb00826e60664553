"""The bridge's options for one vLLM engine, shared by the plugin, the refreshers and the backend.

An engine is *bridged* when it is started with vLLM's weight-transfer config naming the
bridge's backend (``weight_transfer_config={"backend": "weight_bridge"}``, CLI
``--weight-transfer-config '{"backend": "weight_bridge"}'``). Its options come from
``additional_config={"weight_bridge": {...}}`` (CLI ``--additional-config``), fixed when the
engine starts; :meth:`BridgeOptions.from_dict` reads and checks them. Per-update choices a
trainer may make (read-back, NaN/Inf check, hash check) can also be given in
``init_weight_transfer_engine``'s ``init_info``; the checkpoint root never can.

Every option is checked by type and value as its dataclass is built, by one function
(:func:`check_fields`, also run by the callback's :class:`~callbacks.engine.EngineOptions`): the
field's declared type (a ``bool`` is a boolean, never YAML's ``"false"``, ``"no"`` or ``2``; a
number never a boolean or a string; ``None`` only where the type is optional; a ``Literal``
one of its values; a ``dict`` a mapping) and a small table of the values allowed
(:data:`ALLOWED`). A refusal is an :class:`OptionError` naming the option and what it allows,
on the trainer's side when a spec is built and in the engine when its config is read.
"""

from __future__ import annotations

import os
import types
import typing
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal, Union

from ..direct.readback import READBACK_MODES
from ..errors import WeightBridgeError

BACKEND = "weight_bridge"  # the backend's name in vLLM's factories, and its additional_config key
# the method name the engine core routes to the backend's read-only queries (any client sends it)
BACKEND_RPC = "weight_bridge.call_backend"
ROOT_ENV = "WEIGHT_BRIDGE_CHECKPOINT_ROOT"  # the default checkpoint root of the bridge's engines
# what init_weight_transfer_engine's init_info may change for a running engine
SESSION_FIELDS = ("reload_mode", "readback", "check_finite", "verify_hash", "rollback")
CPU_LINEAR_MODES = ("torch", "repack", "stock")
ReloadMode = Literal["direct", "layerwise", "auto", "vllm-direct"]
RELOAD_MODES: tuple[str, ...] = typing.get_args(ReloadMode)


class OptionError(WeightBridgeError, ValueError):
    """An option refused by name (unknown, of the wrong type, or a value not allowed), with
    what is allowed; raised before anything starts (a ``ValueError``: HTTP 400 from a server)."""


@dataclass(frozen=True)
class Above:
    """The numbers allowed: greater than ``low`` (NaN never is)."""

    low: float

    def __contains__(self, value: Any) -> bool:
        return bool(value > self.low)

    def __str__(self) -> str:
        return f"a number > {self.low:g}"


# the values allowed beyond the declared types, by dataclass field (Literal types carry theirs)
ALLOWED: dict[str, tuple[Any, ...] | Above] = {
    "cpu_linear": CPU_LINEAR_MODES,
    "readback": READBACK_MODES,
    "update_timeout_s": Above(0),
    "kv_cache_gb": Above(0),
}


def check_fields(instance: Any, what: str) -> None:
    """Refuse the first field of the dataclass ``instance`` whose value is not of its declared
    type or not in :data:`ALLOWED`, naming it (``what``: e.g. "bridge option") and what it
    allows."""
    hints = typing.get_type_hints(type(instance))
    for f in fields(instance):
        value, allowed = getattr(instance, f.name), ALLOWED.get(f.name)
        kinds = _kinds(hints[f.name])
        if any(_is(value, kind) for kind in kinds) and (
            value is None or allowed is None or value in allowed
        ):
            continue
        must = _describe(kinds, allowed)
        raise OptionError(f"{what} {f.name}={value!r} is refused: {f.name} must be {must}")


def _kinds(declared: Any) -> tuple[Any, ...]:
    """The alternatives of a declared type (``X | None``: X and None)."""
    union = typing.get_origin(declared) in (Union, types.UnionType)
    return typing.get_args(declared) if union else (declared,)


def _is(value: Any, kind: Any) -> bool:
    """Whether ``value`` is of the declared ``kind``, strictly: a bool is no number, and no
    string or number is a bool."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is Any:
        return True
    if kind is type(None):
        return value is None
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if kind is bool:
        return type(value) is bool
    if kind in (int, float):  # an int is a number too
        numbers = (int, float) if kind is float else int
        return isinstance(value, numbers) and type(value) is not bool
    if kind is dict or origin is dict:
        key, item = args or (Any, Any)
        return isinstance(value, Mapping) and all(
            _is(k, key) and _is(v, item) for k, v in value.items()
        )
    return isinstance(value, kind)


_NAMES = {bool: "true or false (a boolean, not a string or a number)", str: "a string"}
_NAMES |= {float: "a number", int: "an integer", type(None): "None (YAML null)"}


def _describe(kinds: tuple[Any, ...], allowed: tuple[Any, ...] | Above | None) -> str:
    """What a field allows, in words: ``one of 'a', 'b' or None (YAML null)``."""
    words = []
    for kind in kinds:
        if kind is not type(None) and allowed is not None:
            words.append(str(allowed) if isinstance(allowed, Above) else _one_of(allowed))
        elif typing.get_origin(kind) is Literal:
            words.append(_one_of(typing.get_args(kind)))
        elif kind is dict or typing.get_origin(kind) is dict:
            words.append("a mapping (of names to values)")
        else:
            words.append(_NAMES.get(kind, getattr(kind, "__name__", str(kind))))
    return " or ".join(words)


def _one_of(values: tuple[Any, ...]) -> str:
    return "one of " + ", ".join(repr(v) for v in values)


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
        check_fields(self, "bridge option")
        if self.checkpoint_root is not None and not os.path.isabs(self.checkpoint_root):
            object.__setattr__(self, "checkpoint_root", os.path.abspath(self.checkpoint_root))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BridgeOptions:
        """The options of a mapping (an engine's ``additional_config`` entry), each checked."""
        known = [f.name for f in fields(cls)]
        if not isinstance(data, Mapping):
            raise OptionError(f"the weight_bridge options must be a mapping, not {data!r}")
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise OptionError(f"unknown weight_bridge options {unknown}; known: {known}")
        return cls(**data)

    def with_session(self, init_info: dict[str, Any]) -> BridgeOptions:
        """These options with a trainer's per-session choices applied (:data:`SESSION_FIELDS`
        only: the checkpoint root, the CPU linear mode and the update timeout are fixed when
        the engine starts)."""
        fixed = sorted(set(init_info) - set(SESSION_FIELDS))
        if fixed:
            raise OptionError(
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
    return BridgeOptions.from_dict({} if raw is None else raw)
