"""The trainer side of the ``weight_bridge`` backend, for code written against vLLM's trainer API.

vLLM's ``WeightTransferTrainerFactory.trainer_init(init_info, client=..., source=...)`` builds a
trainer engine on every trainer rank and ``send_weights()`` drives one update (example and
options: ``docs/api.md``). With this backend a send streams the source's tensors into a
safetensors checkpoint (each gathered, written and freed, so a sharded trainer never holds the
whole model: :class:`~weight_bridge.checkpoint.write.CheckpointWriter`) under ``directory``,
which must lie under the engine's checkpoint root, then sends its path with the same calls as
every other backend. Every rank iterates the source (its gathers are collective); only rank 0
writes and calls the engine.

Contract:

* a send is the one push routine of every client
  (:meth:`~weight_bridge.vllm.clients.bridge_client.BridgeClient.push_async`) on the bridge
  client that reaches vLLM's client (:func:`bridge_client_of`): no pause by default, the same
  typed errors and :class:`~weight_bridge.vllm.report.PushReport` (``last_report``);
* a partial checkpoint is sent only on purpose (``names=``, on ``base_version``): a tensor rank 0
  would not get whole is refused by name with :class:`IncompleteSourceError` on every rank,
  before anything is gathered or written (the source read through
  :mod:`~weight_bridge.vllm.internals.sources`);
* files follow the callback's policy (:mod:`weight_bridge.sync.retention`): the n-th send
  writes ``step-{n:08d}.safetensors``, counting on from the last step file in ``directory``, and
  :func:`~weight_bridge.sync.retention.prune` keeps the newest ``keep_last_k`` besides every
  one the engine serves; with no ``version`` the engine labels the weights by the file name
  (:func:`~weight_bridge.checkpoint.version_of`);
* deltas follow the callback's keyframe policy (:mod:`~weight_bridge.delta.keyframes`,
  :mod:`~weight_bridge.delta.state`; why: ``last_choice``) on a clock of sends; a
  partial send makes the next complete one a keyframe. The reference copy lives in rank 0's host
  memory only, is freed by :meth:`~WeightBridgeTrainer.shutdown` and never saved, so a restarted
  trainer starts with a keyframe.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    materialize_full_tensor,
)

from ...checkpoint.format import VERSION_KEY
from ...checkpoint.write import SavedCheckpoint
from ...delta.keyframes import KeyframeClock, delta_mode
from ...delta.sink import Sink
from ...delta.state import DeltaState
from ...errors import WeightBridgeError
from ...sync.retention import StepFiles, step_file, unused_step
from ...sync.sender import Sender, Turn, Written
from ..internals.sources import full_tensors, sender_gaps, source_metadata
from ..options import BACKEND
from ..report import PushReport
from .bridge_client import check_inflight

_HOW = (
    "make rank 0 own every tensor it sends (put it in each parameter's device mesh, e.g. shard "
    "over every trainer rank), give the source an iter_full() that yields full tensors on rank "
    "0, or send only the tensors rank 0 has, on purpose, with send_weights(names=...) on top of "
    "a complete checkpoint"
)


class IncompleteSourceError(WeightBridgeError, ValueError):
    """Rank 0 would write a partial checkpoint it was not asked for: the source does not give
    it these tensors whole. Raised before anything is written or sent (the engine keeps its
    version): from metadata before any gather, or for a tensor a source yields in part.
    ``problems``: tensor name -> why, the same shape as
    :attr:`~weight_bridge.direct.DirectReloadError.problems`."""

    def __init__(self, problems: dict[str, str]) -> None:
        self.problems = dict(problems)
        by_reason: dict[str, list[str]] = {}
        for name, why in self.problems.items():
            by_reason.setdefault(why, []).append(name)
        listed = "; ".join(
            ", ".join(map(repr, names[:8]))
            + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            + f": {why}"
            for why, names in by_reason.items()
        )
        super().__init__(
            f"the WeightSource does not give rank 0 (the sender) {len(self.problems)} "
            f"tensor(s) whole, so its checkpoint would be partial: {listed}. Nothing was "
            f"written or sent: {_HOW}"
        )


@dataclass
class WeightBridgeTrainerInitInfo(TrainerInitInfo):
    """Where the trainer saves checkpoints (under the engine's checkpoint root), how many it
    keeps, the session options sent to the engine (see
    :data:`~weight_bridge.vllm.options.SESSION_FIELDS`), the pushes' in-flight mode (None:
    no pause, as vLLM's trainer API; see :mod:`~weight_bridge.vllm.clients.bridge_client`) and
    deltas (``delta``, ``full_every_k``: as the callback's ``Schedule``; see
    the module)."""

    backend: ClassVar[str] = BACKEND
    directory: str = "."
    keep_last_k: int = 2
    session: dict[str, Any] = field(default_factory=dict)
    inflight: str | None = None
    delta: str = "auto"
    full_every_k: int | None = None

    def __post_init__(self) -> None:
        self.delta = delta_mode(self.delta, self.full_every_k)


class WeightBridgeTrainer(TrainerWeightTransferEngine[WeightBridgeTrainerInitInfo]):
    """Save, then push the path with the one push routine: vLLM's trainer engine for the
    ``weight_bridge`` backend. ``bridge``: the bridge client the sender pushes with (None on
    the other ranks); ``last_report``: the report of the last send; ``last_choice``: why it
    was a delta or not, with the costs measured (``delta="auto"``); ``sender``: the one sender
    (:class:`~weight_bridge.sync.sender.Sender`, the callback's too), with its delta state
    (what the engine reported, the keyframe clock, the reference copy; None on the other
    ranks)."""

    init_info_cls = WeightBridgeTrainerInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = WeightBridgeTrainerInitInfo(rank=0 if is_sender else 1)
        self.bridge: Any = bridge_client_of(client) if is_sender else None
        self._owns_bridge = self.bridge is not None and self.bridge is not client
        self.last_version: str | None = None  # the label the engine stamped on the last send
        self.last_report: PushReport | None = None
        self.rounds = 0  # sends so far: the step of the next file
        self.sender = _sender(self.info, self.bridge) if is_sender else None
        self.last_choice: dict[str, Any] = {}  # why the last send was a delta or not

    @classmethod
    def trainer_init(
        cls, init_info: WeightBridgeTrainerInitInfo, *, client: Any, source: Any = None
    ) -> WeightBridgeTrainer:
        check_inflight(init_info.inflight)
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.info = init_info
        engine.sender = _sender(init_info, engine.bridge) if engine.is_sender else None
        if engine.is_sender:
            _open_session(client, engine.bridge, dict(init_info.session))
        return engine

    def send_weights(  # type: ignore[override]
        self,
        version: str | None = None,
        names: Iterable[str] | None = None,
        base_version: str | None = None,
    ) -> Path | None:
        """One update: the source saved as a checkpoint (a keyframe or a delta, see the module;
        only ``names``: a partial one on top of ``base_version``), pushed; the path on the
        sender, None elsewhere. With no ``version`` the engine labels the weights by the file's
        name (see the module). A refusal or failure raises the bridge's typed error (the engine
        keeps its version) and makes the next send a keyframe."""
        if self.source is None:
            raise ValueError("WeightBridgeTrainer needs a WeightSource (source=...)")
        wanted = set(names) if names is not None else None
        metas = [m for m in source_metadata(self.source) if wanted is None or m.name in wanted]
        gaps = sender_gaps(self.source, metas, self.is_sender)
        if gaps:  # before any gather or write: every rank (0.33+) refuses alike
            raise IncompleteSourceError(gaps)
        # never a name a chain of an earlier trainer may still carry (a restart starts past it)
        self.rounds = max(self.rounds + 1, unused_step(Path(self.info.directory)))
        path = step_file(Path(self.info.directory), self.rounds)
        if self.sender is None:  # not the sender: take part in the source's gathers
            self._write(path, metas, wanted, None)
            return None
        base = self.last_version
        if wanted is not None:
            base = base_version if base_version is not None else self.last_version
            if base is None:
                raise ValueError("a partial send needs a base_version (no version was sent yet)")
        metadata = {VERSION_KEY: str(version)} if version is not None else {}
        sent_version = None if version is None else str(version)
        turn = self.sender.turn(base, partial_only=wanted is not None)
        engine = self.sender.deltas.engine

        def write(turn: Turn) -> Written:
            specs = [  # floating tensors in the engine's dtypes
                (m.name, torch.empty(m.shape, dtype=engine.dtype(m.name, m.dtype), device="meta"))
                for m in metas
            ]
            sink = turn.opener(path, specs, {**metadata, **turn.metadata})
            saved = self._write(path, metas, wanted, sink)
            assert saved is not None  # the sender's
            return Written(str(path), saved.bytes, turn.kind == "partial")

        def push(where: Path) -> PushReport:
            return self.bridge.push(where, sent_version, inflight=self.info.inflight)

        # a send of names= is no full sync: its cost is not what delta="auto" weighs
        sent = self.sender.send(path, turn, write, push, measured=wanted is None)
        self.last_report, self.last_choice = sent.report, sent.choice
        self.last_version = None if sent.report.version is None else str(sent.report.version)
        return path

    def _write(
        self, path: Path, metas: list[Any], wanted: set[str] | None, sink: Sink | None
    ) -> SavedCheckpoint | None:
        """Stream the source's full tensors (every rank: a ``DTensor`` is gathered
        collectively) into ``sink`` (the sender's; None elsewhere). A tensor that comes other
        than whole (a source whose ``iter_full`` yields a piece, or whose cached metadata no
        longer describes the model) is refused by name; the sink then leaves no file."""
        assert self.source is not None
        shapes = {m.name: tuple(m.shape) for m in metas}
        stream = full_tensors(self.source)
        try:
            for name, tensor in stream:
                if wanted is not None and name not in wanted:
                    continue
                full = materialize_full_tensor(tensor)  # collective for a DTensor: every rank
                if sink is not None and full is not None:  # None: 0.32, a name not held here
                    if tuple(full.shape) != shapes.get(name, tuple(full.shape)):
                        raise IncompleteSourceError(
                            {
                                name: f"yielded with shape {tuple(full.shape)}, not its full "
                                f"shape {shapes[name]} (ParamMeta.shape; vLLM 0.33+ caches "
                                "metadata: a module changed after its first read lands here)"
                            }
                        )
                    # cast to the file's dtype, chunk by chunk (a delta: diffed as it arrives)
                    sink.write(name, full.detach(), cast=True)
                del full
            return sink.finish() if sink is not None else None
        except BaseException:
            if sink is not None:
                sink.abort()
            raise

    def shutdown(self) -> None:
        """Close the bridge client this trainer built (never one it was given); the reference
        copy's host memory goes."""
        if self.sender is not None:
            self.sender.deltas.release()
        if self._owns_bridge:
            self.bridge.close()


def _sender(info: WeightBridgeTrainerInitInfo, bridge: Any) -> Sender:
    """The sender of ``info``'s sends (the one sender, as the callback's): the keyframe clock of
    its delta options (no ``skip_frozen``: a send between keyframes is a delta or complete,
    never partial by itself), started on ``info.directory`` (``delta="auto"`` weighs where the
    bytes go); after each send the newest ``keep_last_k`` step files are kept besides what the
    engine serves, and a failed send's file goes unless the engine serves it."""
    state = DeltaState(KeyframeClock(info.delta, info.full_every_k))
    state.start(info.directory)
    return Sender(state, StepFiles(info.keep_last_k, bridge))


def bridge_client_of(client: Any) -> Any:
    """The bridge client that reaches the engine behind vLLM's weight-sync ``client``: a client
    of the bridge (anything with ``push``) as it is; vLLM's ``HTTPVLLMWeightSyncClient`` as an
    :class:`~weight_bridge.vllm.clients.http.HTTPClient` on its ``base_url`` (no pause by
    default); a ``vllm.LLM`` as its :class:`~weight_bridge.vllm.clients.llm.LLMClient`.
    Anything else is refused by name: a push needs the engine's own answer (its outcome), which
    vLLM's four calls do not carry."""
    if hasattr(client, "push"):
        return client
    from vllm.distributed.weight_transfer.clients import (
        HTTPVLLMWeightSyncClient,
        RayVLLMWeightSyncClient,
    )

    if isinstance(client, HTTPVLLMWeightSyncClient):
        from .http import HTTPClient

        return HTTPClient(client.base_url, timeout_s=client.timeout, inflight=None)
    how = (
        "pass weight_bridge.connect(url) or HTTPVLLMWeightSyncClient(url) for a server, a "
        "vllm.LLM, or a client of the bridge (LLMClient, AsyncLLMClient(engine, loop=...))"
    )
    if isinstance(client, RayVLLMWeightSyncClient):
        raise TypeError(
            "WeightBridgeTrainer cannot push through a RayVLLMWeightSyncClient: Ray actor "
            "handles carry vLLM's four calls only, not the engine's outcome the bridge reports "
            f"and raises typed errors from; {how}"
        )
    from .by_name import client_for

    try:
        return client_for(client)
    except TypeError as exc:
        raise TypeError(
            f"WeightBridgeTrainer cannot push through a {type(client).__name__} ({exc}); {how}"
        ) from None


def _open_session(client: Any, bridge: Any, session: dict[str, Any]) -> None:
    """vLLM's init handshake: the trainer's session options
    (:data:`~weight_bridge.vllm.options.SESSION_FIELDS`) sent to the engine."""
    if bridge is client:  # a client of the bridge, as given: only options asked for
        if not session:
            return
        configure = getattr(bridge, "configure", None)
        if configure is None:
            raise TypeError(
                f"{type(bridge).__name__} cannot set session options {sorted(session)}: give "
                "them when the engine starts"
            )
        configure(**session)
    elif hasattr(bridge, "llm"):  # a vllm.LLM
        bridge.llm.init_weight_transfer_engine({"init_info": session})
    else:  # vLLM's HTTP client: its own call
        client.init_weight_transfer_engine(session)


def _register() -> None:
    """Importing this module (to build a :class:`WeightBridgeTrainerInitInfo`) registers the
    trainer side in vLLM's factory, so a trainer process with no engine needs nothing else."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    with contextlib.suppress(ValueError):  # registered already (the plugin, or an earlier import)
        WeightTransferTrainerFactory.register_engine(BACKEND, WeightBridgeTrainer)


_register()
