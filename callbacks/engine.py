"""The engine a callback pushes into, described by one option, with typed options.

A callback is given an engine the user built (any client of the bridge, or a ``vllm.LLM``
started with its backend), or an :class:`EngineSpec`: a model directory to start an engine on
(in the callback's ``setup``, reading checkpoints only from the sync's directory, closed at
``teardown``), or the URL of a ``vllm serve`` process already running the bridge's backend.
One option instead of loose arguments, so a LightningCLI YAML says it in one mapping, its
options typed (:class:`EngineOptions`) and checked when the spec is built, before anything
starts: a misspelt key is refused by name, with the closest valid one, and a value by its
declared type and the values allowed (YAML's ``"false"`` for a boolean, ``"120"`` for a
number, a list for a mapping, a negative size: :func:`~weight_bridge.vllm.options.check_fields`,
the one check the engine runs on its bridge options too), as the CLI builds the callback, not
found late (:class:`~weight_bridge.vllm.options.OptionError`)::

    engine:
      model: /models/policy
      mode: serve
      options: {kv_cache_gb: 1, inflight: drain, engine_args: {max_model_len: 128}}
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from weight_bridge import BridgeOptions
from weight_bridge.sync.adapter import AdapterPlan, adapter_plan
from weight_bridge.vllm import ENGINE_MODES, EngineClient, client_for, connect, start_engine
from weight_bridge.vllm.options import OptionError, check_fields

_BRIDGE = {f.name: f"bridge.{f.name}" for f in fields(BridgeOptions)}  # where each one goes


def _built(cls: type[Any], data: Mapping[str, Any], what: str, also: Sequence[str] = ()) -> Any:
    """``cls(**data)``, an unknown key refused by name with the closest valid one (each value
    is then checked by ``cls`` itself)."""
    if not isinstance(data, Mapping):
        raise OptionError(f"{what}s must be a mapping of names to values, not {data!r}")
    known = [f.name for f in fields(cls)]
    for key in data:
        if key not in known:
            near = difflib.get_close_matches(key, [*known, *also], n=1)
            hint = f"did you mean {near[0]!r}?" if near else f"valid: {', '.join(known)}"
            raise OptionError(f"unknown {what} {key!r} ({hint})")
    return cls(**data)


@dataclass(frozen=True)
class EngineOptions:
    """What the engine a spec starts, or the client it connects, takes besides its model.

    ``inflight``: what a push does to requests in flight (``recompute``, ``keep``, ``drain``;
    None: no pause), where there can be any (mode ``async`` or ``serve``, or a ``url``).
    ``kv_cache_gb``: the engine's KV cache per worker in GiB, a number > 0 (unset: colocated
    memory defaults). ``cpu_threads_bind`` (CPU backend; mode ``async`` or ``ranks``): a
    string, the cores the engine's workers compute on (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``,
    e.g. ``"0|1"`` for two ranks).
    ``bridge``: what the engine does on an update, by name and checked as
    :class:`~weight_bridge.BridgeOptions` (``readback``, ``reload_mode``, ``verify_hash``...;
    the checkpoint root is the sync's directory unless set): a mapping, as YAML gives it
    (jsonargparse would drop a misspelt key of a dataclass nested this deep, unseen).
    ``engine_args``: a mapping passed through as it is, checked by the engine when it starts: vLLM's
    engine arguments (``dtype``, ``max_model_len``, ``tensor_parallel_size``...) and the
    engine's other keywords (``plugins``, ``rpc_timeout_s``; ``api_key`` and ``log`` for
    ``serve``; ``api_key`` alone for a ``url``). Each field is checked by its declared type
    and allowed values (:func:`~weight_bridge.vllm.options.check_fields`).
    """

    inflight: Literal["recompute", "keep", "drain"] | None = "recompute"
    kv_cache_gb: float | None = None
    cpu_threads_bind: str | None = None
    bridge: dict[str, Any] = field(default_factory=dict)
    engine_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_fields(self, "engine option")  # each value by its type
        _built(BridgeOptions, self.bridge, "bridge option")  # each name, and its value
        typed = _BRIDGE | {f.name: f.name for f in fields(self)}
        for key in set(self.engine_args) & set(typed):
            raise OptionError(f"engine_args {key!r} is a typed engine option: set {typed[key]}")


# where an option set away from its default means something ("url": a running server's client;
# a colocated or ranks engine generates and is pushed on one thread: nothing is in flight)
_APPLIES = {"inflight": ("async", "serve", "url"), "cpu_threads_bind": ("async", "ranks")}
_APPLIES |= {"kv_cache_gb": ENGINE_MODES, "bridge": ENGINE_MODES}


@dataclass(frozen=True)
class EngineSpec:
    """Which engine to push into: start one on ``model`` (``mode``: ``"colocated"``, a
    ``vllm.LLM`` in this process; ``"async"``, an ``AsyncLLM`` on its own loop; ``"serve"``, a
    ``vllm serve`` process; ``"ranks"``, a ``vllm.LLM`` inside every trainer rank,
    tensor-parallel over them and pushed from the live tensors, no file) or connect to ``url``;
    ``options``: what that engine or client takes (:class:`EngineOptions`, or a mapping of its
    fields), each option refused in a mode it does not apply to."""

    model: str | None = None
    url: str | None = None
    mode: str = "colocated"
    options: EngineOptions = field(default_factory=EngineOptions)

    def __post_init__(self) -> None:
        if isinstance(self.options, Mapping):
            options = _built(EngineOptions, self.options, "engine option", [*_BRIDGE.values()])
            object.__setattr__(self, "options", options)
        if not isinstance(self.options, EngineOptions):
            raise OptionError(f"engine options must be a mapping, not {self.options!r}")
        if (self.model is None) == (self.url is None):
            raise OptionError("an EngineSpec needs a model to start an engine on, or a url")
        if self.mode not in ENGINE_MODES:
            raise OptionError(f"engine mode must be one of {ENGINE_MODES}, not {self.mode!r}")
        if self.url is not None and self.mode != "colocated":
            raise OptionError(f"an engine at a url is already running: no mode ({self.mode!r})")
        where, default = ("url" if self.url else self.mode), EngineOptions()
        for name, modes in _APPLIES.items():
            if getattr(self.options, name) != getattr(default, name) and where not in modes:
                raise OptionError(f"{name} applies to mode {' or '.join(modes)}, not {where}")

    @property
    def in_ranks(self) -> bool:
        """Whether the engine runs inside the trainer's ranks (pushed from live tensors)."""
        return self.model is not None and self.mode == "ranks"

    @property
    def starts(self) -> bool:
        """Whether the callback starts (and closes) the engine."""
        return self.model is not None

    @property
    def args(self) -> dict[str, Any]:
        """The options as the flat keywords :func:`~weight_bridge.start_engine` takes."""
        o = self.options
        bind = {} if o.cpu_threads_bind is None else {"cpu_threads_bind": o.cpu_threads_bind}
        flat = dict(inflight=o.inflight, kv_cache_gb=o.kv_cache_gb, **o.bridge, **bind)
        return {**flat, **o.engine_args}

    def connect(self) -> EngineClient:
        """A client of the running server at ``url``."""
        assert self.url is not None
        return connect(self.url, inflight=self.options.inflight, **self.options.engine_args)

    def start(
        self,
        checkpoint_root: Path,
        devices_per_node: int = 1,
        defaults: Mapping[str, Any] | None = None,
    ) -> EngineClient:
        """The engine on ``model``, reading checkpoints from ``checkpoint_root`` only (unless
        ``options.bridge`` names another); in the trainer's ranks tensor-parallel over a node's
        ``devices_per_node`` ranks (the trainer's own count: ``LOCAL_WORLD_SIZE`` may be stale,
        vLLM's CPU platform rewrites it in any process that started an engine) unless
        ``engine_args`` says otherwise; ``defaults``: engine arguments the policy needs (LoRA
        slots for an adapter), each unless ``engine_args`` sets it."""
        assert self.model is not None
        args = self.args
        args.setdefault("checkpoint_root", str(checkpoint_root))
        for key, value in (defaults or {}).items():
            args.setdefault(key, value)
        if self.in_ranks:
            args.setdefault("tensor_parallel_size", devices_per_node)
        return start_engine(self.model, self.mode, **args)


def engine_of(engine: EngineSpec | dict[str, Any] | Any) -> tuple[EngineSpec | None, Any]:
    """A callback's ``engine``: its spec (a mapping from YAML becomes one) and the client
    ready now (None until an engine to start is started)."""
    if engine is None:
        return None, None
    if isinstance(engine, argparse.Namespace):  # jsonargparse's, when building the spec raised
        engine = engine.as_dict()
    if isinstance(engine, dict):
        engine = EngineSpec(**engine)
    if isinstance(engine, EngineSpec):
        return engine, None if engine.starts else engine.connect()
    return None, client_for(engine)


def adapter_sync(
    spec: EngineSpec | None, engine: Any, module: Any, world_size: int
) -> AdapterPlan | None:
    """How a policy syncs (:class:`~weight_bridge.sync.adapter.AdapterPlan`; None: not a PEFT
    model): its adapter where the model and the engine allow it, else merged weights, the
    reason said. An engine the user built pushes adapters only where it has LoRA slots: one
    without them keeps the merged pushes it took before (it cannot load an adapter, and the
    user chose it), the reason in every sync's record."""
    plan = adapter_plan(module)
    if plan is None or not plan.pushes:
        return plan
    if world_size > 1:
        return plan.fallback(f"{world_size} ranks: adapter pushes serve one rank's engine so far")
    if spec is None:
        if not getattr(engine, "takes_adapters", False):
            return plan.fallback(
                "the engine given has no LoRA slots (a vllm.LLM in this process started with "
                "enable_lora=True takes adapter pushes)"
            )
        return plan
    if spec.url is not None or spec.mode != "colocated":
        where = "an engine at a url" if spec.url else f"engine mode {spec.mode!r}"
        return plan.fallback(f"{where}: adapter pushes run in a colocated engine so far")
    args = spec.options.engine_args
    if args.get("enable_lora", True) is False:
        return plan.fallback("engine_args sets enable_lora=False")
    if int(args.get("tensor_parallel_size", 1)) > 1:
        return plan.fallback("tensor_parallel_size > 1: adapter pushes write one worker so far")
    return plan
