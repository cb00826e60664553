"""The trainer side of the ``weight_bridge`` backend, for code written against vLLM's trainer API.

vLLM's ``WeightTransferTrainerFactory.trainer_init(init_info, client=..., source=...)`` builds a
trainer engine on every trainer rank; ``send_weights()`` then drives one update. With the
bridge's backend, sending means: stream the source's tensors into a safetensors checkpoint
(each gathered, written at its offset and freed, so a sharded trainer never holds the whole
model: :class:`~weight_bridge.checkpoint.write.CheckpointWriter`), then send its path with the
same four calls as every other backend::

    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from weight_bridge.vllm.clients.trainer_api import WeightBridgeTrainerInitInfo

    sender = WeightTransferTrainerFactory.trainer_init(
        WeightBridgeTrainerInitInfo(directory="/ckpts", rank=0),
        client=HTTPVLLMWeightSyncClient("http://127.0.0.1:8000"),
        source=ModuleSource(model),
    )
    sender.send_weights(version="10")

``directory`` must lie under the engine's checkpoint root (the engine reads nothing else). Every
rank iterates the source (a ``DTensor`` is gathered collectively); only the sender (rank 0)
writes and calls the engine. ``send_weights(names=...)`` sends a *partial* checkpoint holding
only those tensors, on top of ``base_version`` (default: the version sent last).

The files follow the callback's policy (:mod:`weight_bridge.checkpoint.retention`): the n-th send
writes ``step-{n:08d}.safetensors`` (:func:`~weight_bridge.checkpoint.step_file`; a trainer
started on a directory that holds step files already counts on from the last of them, so it
never reuses a name a long-lived engine's chain carries), fsynced, and
after each send :func:`~weight_bridge.checkpoint.retention.prune` keeps the newest ``keep_last_k``
step files of ``directory`` besides every one the engine serves (the last complete checkpoint
and the partial ones sent on top of it). With no ``version`` the file carries none and none is
sent: the engine labels the weights by its one rule, which
:func:`~weight_bridge.checkpoint.version_of` predicts here (the file name, ``step-00000001``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    materialize_full_tensor,
)

from ...checkpoint import BASE_VERSION_KEY, VERSION_KEY, step_file, version_of
from ...checkpoint.retention import prune, unused_step
from ...checkpoint.write import CheckpointWriter
from ..options import BACKEND

__all__ = ["WeightBridgeTrainer", "WeightBridgeTrainerInitInfo"]


@dataclass
class WeightBridgeTrainerInitInfo(TrainerInitInfo):
    """Where the trainer saves checkpoints (under the engine's checkpoint root), how many it
    keeps, and the session options sent to the engine (see
    :data:`~weight_bridge.vllm.options.SESSION_FIELDS`)."""

    backend: ClassVar[str] = BACKEND
    directory: str = "."
    keep_last_k: int = 2
    session: dict[str, Any] = field(default_factory=dict)


class WeightBridgeTrainer(TrainerWeightTransferEngine[WeightBridgeTrainerInitInfo]):
    """Save, then send the path: vLLM's trainer engine for the ``weight_bridge`` backend."""

    init_info_cls = WeightBridgeTrainerInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = WeightBridgeTrainerInitInfo(rank=0 if is_sender else 1)
        self.served: list[Path] = []  # what the engine serves: the last complete send and after
        self.last_version: str | None = None
        self.rounds = 0  # sends so far: the step of the next file

    @classmethod
    def trainer_init(
        cls, init_info: WeightBridgeTrainerInitInfo, *, client: Any, source: Any = None
    ) -> WeightBridgeTrainer:
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.info = init_info
        if engine.is_sender:
            client.init_weight_transfer_engine(dict(init_info.session))
        return engine

    def send_weights(  # type: ignore[override]
        self,
        version: str | None = None,
        names: Iterable[str] | None = None,
        base_version: str | None = None,
    ) -> Path | None:
        """One update: the source saved as a checkpoint (only ``names``: a partial one on top
        of ``base_version``), its path sent; the path on the sender, None elsewhere. With no
        ``version`` the engine labels the weights by the file's name (see the module)."""
        if self.source is None:
            raise ValueError("WeightBridgeTrainer needs a WeightSource (source=...)")
        # never a name a chain of an earlier trainer may still carry (a restart starts past it)
        self.rounds = max(self.rounds + 1, unused_step(Path(self.info.directory)))
        wanted = set(names) if names is not None else None
        metadata = {VERSION_KEY: str(version)} if version is not None else {}
        if wanted is not None:
            base = base_version if base_version is not None else self.last_version
            if base is None:
                raise ValueError("a partial send needs a base_version (no version was sent yet)")
            metadata[BASE_VERSION_KEY] = str(base)
        path = step_file(Path(self.info.directory), self.rounds)
        if not self._write(path, wanted, metadata):
            return None
        info = {"checkpoint": str(path.resolve())}
        if version is not None:
            info[VERSION_KEY] = str(version)
        self.client.start_weight_update()
        self.client.update_weights(info)
        self.client.finish_weight_update(str(version) if version is not None else None)
        self.last_version = version_of(str(path), metadata.get(VERSION_KEY))
        self.served = [*self.served, path] if wanted is not None else [path]
        prune(path.parent, path, max(self.info.keep_last_k, 1), self.served)
        return path

    def _write(self, path: Path, wanted: set[str] | None, metadata: dict[str, str]) -> bool:
        """Stream the source (every rank: a ``DTensor`` is gathered collectively) into ``path``
        (the sender only); whether this rank wrote it."""
        assert self.source is not None
        metas = [m for m in self.source.metadata() if wanted is None or m.name in wanted]
        writer = (
            CheckpointWriter(path, [(m.name, m) for m in metas], metadata)
            if self.is_sender
            else None
        )
        try:
            for name, tensor in self.source:
                if wanted is not None and name not in wanted:
                    continue
                full = materialize_full_tensor(tensor)  # collective for a DTensor: every rank
                if writer is not None:
                    writer.write(name, full.detach().cpu())
                del full
            if writer is None:
                return False
            writer.finish()
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        return True


def _register() -> None:
    """Importing this module (to build a :class:`WeightBridgeTrainerInitInfo`) registers the
    trainer side in vLLM's factory, so a trainer process with no engine needs nothing else."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    with contextlib.suppress(ValueError):  # registered already (the plugin, or an earlier import)
        WeightTransferTrainerFactory.register_engine(BACKEND, WeightBridgeTrainer)


_register()
