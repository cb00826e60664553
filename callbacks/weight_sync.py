"""``VLLMWeightSync``: a Lightning callback that keeps a colocated vLLM engine on the live policy.

On-policy RL loops generate with the weights being trained. Instead of a weight-transfer
protocol, the callback saves the module's weights as one safetensors checkpoint (streamed,
atomic, hashed) and pushes it into an engine, which copies the bytes in place into its live
storage. A checkpoint on disk is also what a cold start would load, so what the engine serves
after a push is exactly what a fresh engine on that file would serve.

The callback wires the parts together and only calls down into them:
:class:`~callbacks.schedule.SyncClock` decides when (and whether a sync is complete, partial or
a delta); the sync itself is :mod:`weight_bridge.sync`'s: the
:class:`~weight_bridge.sync.gather.Gatherer` what is sent and how each tensor reaches the writer
(DTensors of sharded trainers one at a time), the transport (:mod:`weight_bridge.sync.transport`,
chosen once from the engine) how the tensors travel and the push into the engine (any
:class:`~weight_bridge.vllm.clients.bridge_client.EngineClient`),
:class:`~weight_bridge.delta.state.DeltaState` what the engine reported and the writer's
reference copy, :class:`~weight_bridge.sync.collective.Collective` makes each step fail on every
rank or none.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from weight_bridge.delta.state import DeltaState
from weight_bridge.sync import CheckpointFiles, Sender, release, step_file
from weight_bridge.sync.canary import CanaryCheck
from weight_bridge.sync.collective import Collective, StepFailed
from weight_bridge.sync.gather import Gatherer
from weight_bridge.sync.names import ENGINE, CheckpointNames
from weight_bridge.sync.retention import adapter_dir
from weight_bridge.sync.transport import SyncStep, transport_for
from weight_bridge.vllm import EngineClient

from .directory import open_dir
from .engine import EngineSpec, adapter_sync, engine_of
from .records import sync_line, sync_metrics, sync_record
from .schedule import Schedule, SyncClock, in_ranks_schedule


class VLLMWeightSync(Callback):
    """Push the trained weights into a colocated vLLM engine every few optimizer steps.

    Args:
        engine: the engine to push into: one you built (any :class:`~weight_bridge.EngineClient`,
            or a ``vllm.LLM`` started with the ``weight_bridge`` backend), or an
            :class:`~callbacks.engine.EngineSpec` (a mapping in YAML): a model to start an
            engine on in :meth:`setup` (closed in :meth:`teardown`; under ``ddp_spawn`` each
            rank builds its own), or the URL of a ``vllm serve`` process running the backend
            whose checkpoint root holds ``files.dirpath``.
        schedule: when to sync, when a sync must be complete, and deltas (:class:`Schedule`).
        files: where checkpoints go and how many are kept (:class:`CheckpointFiles`).
        names: checkpoint names and dtype (:class:`CheckpointNames`; by default each tensor in
            the dtype the engine holds it in, once the engine said).
        source: the LightningModule attribute holding the model (``""``: the module itself),
            or a callable ``pl_module -> state dict``.
        canary: check every push end to end (:class:`~weight_bridge.sync.canary.CanaryCheck`;
            ``True``: with defaults); the logprob gap is logged as ``weight_sync/canary_gap``.
        enabled: ``False`` makes the callback a no-op: no files, no engine (a per-run switch:
            ``--trainer.callbacks.init_args.enabled=false`` with LightningCLI).
        on_error: ``"raise"``, or ``"warn"``: a failed save, push or canary becomes a warning
            and the engine stays on the last good version (it rolls a failed push back itself);
            the next sync is complete.

    Either way :meth:`setup` exposes the engine as ``pl_module.vllm_engine``, so a rollout in
    ``training_step`` reads ``self.vllm_engine.generate(prompts, sampling)``, any engine mode; each
    ``Generation``'s ``policy_version`` is the step pushed, a string. Every sync runs through the
    one sender (:class:`~weight_bridge.sync.Sender`, shared with vLLM's trainer API): the
    ranks plan the checkpoint from metadata, the writer (global rank zero, or each node's local
    rank zero with ``files.node_local``) streams it to ``step-{step:08d}.safetensors``, and every
    rank with an engine pushes it. Sharded trainers (FSDP2 via ``ModelParallelStrategy``) gather
    one tensor at a time, every rank taking part. With deltas (``schedule.delta``) a sync between
    keyframes writes only the values that changed (:mod:`weight_bridge.delta.state`). A PEFT
    LoRA policy syncs its adapter instead (``step-{step:08d}.adapter``, a PEFT directory the
    engine writes into its LoRA slots; an engine the callback starts gets LoRA enabled), or,
    where the adapter or the engine cannot take it, merged weights, the reason in each record's
    ``adapter`` (:func:`~callbacks.engine.adapter_sync`).
    Only ``fit`` builds an engine and pushes. Metrics (to the trainer's loggers):
    ``weight_sync/{save_s,push_s,bytes,version,delta}`` (and ``changed_fraction`` for a delta);
    ``history`` holds the last ``history_limit`` syncs (:func:`~callbacks.records.sync_record`).
    """

    history_limit = 256

    def __init__(
        self,
        engine: EngineSpec | EngineClient | Any = None,
        schedule: Schedule = Schedule(),  # noqa: B008 (frozen: shared safely)
        files: CheckpointFiles = CheckpointFiles(),  # noqa: B008
        names: CheckpointNames = CheckpointNames(),  # noqa: B008
        source: str | Callable[[Any], Any] = "model",
        canary: CanaryCheck | bool | None = None,
        enabled: bool = True,
        on_error: str = "raise",
    ) -> None:
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error must be 'raise' or 'warn', not {on_error!r}")
        self.enabled = enabled
        if self.enabled and engine is None:
            raise ValueError(
                "VLLMWeightSync needs an engine: one you built, or an EngineSpec (a model to "
                "start one on, or the url of a vllm serve process)"
            )
        self.spec, self._engine = engine_of(engine)
        self._owns_engine = False
        self.files = files
        self.canary = CanaryCheck() if canary is True else (canary or None)
        self.on_error = on_error
        module_attr, getter = (source, None) if isinstance(source, str) else ("", source)
        self.gatherer = Gatherer(names, module_attr, getter, fsync=files.durable)
        in_ranks = self.spec is not None and self.spec.in_ranks
        self.clock = SyncClock(in_ranks_schedule(schedule) if in_ranks else schedule)
        self.deltas = DeltaState(self.clock, self.gatherer.engine, names.dtype == ENGINE)
        self.transport = transport_for(in_ranks)(self.gatherer, files, self.deltas, self.canary)
        self.transport.engine = self._engine
        self.sender = Sender(self.deltas, self.transport)
        self.last_checkpoint: str | None = None
        self._history: deque[dict[str, Any]] = deque(maxlen=self.history_limit)
        self._dir: Path | None = None
        self._in_ram = False

    # -- what users and the recipe read --------------------------------------------------------

    @property
    def engine(self) -> EngineClient | None:
        """The engine pushed into (None when disabled or not built yet)."""
        return self._engine

    @property
    def schedule(self) -> Schedule:
        return self.clock.schedule

    @property
    def names(self) -> CheckpointNames:
        return self.gatherer.names

    @property
    def module_attr(self) -> str:
        return self.gatherer.module_attr

    @property
    def last_pushed_step(self) -> int | None:
        return self.clock.last_pushed_step

    @property
    def history(self) -> list[dict[str, Any]]:
        """The last ``history_limit`` successful syncs, oldest first (a copy)."""
        return list(self._history)

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(module_attr=self.module_attr)

    @override
    def state_dict(self) -> dict[str, Any]:
        """What a resume needs. Not the reference copy deltas are taken against (host memory
        the size of the synced weights, and only right for the engine it was pushed to): a
        resumed run starts with a keyframe."""
        return {"last_pushed_step": self.last_pushed_step, "last_checkpoint": self.last_checkpoint}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.clock.last_pushed_step = state_dict.get("last_pushed_step")
        self.last_checkpoint = state_dict.get("last_checkpoint")

    # -- lifetime ----------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not self.enabled:
            _expose(pl_module, None)
            return
        if stage == "fit":
            need = self.gatherer.estimate_bytes(pl_module)
            s = self.schedule  # a partial or delta chain holds its complete base too
            chained = s.skip_frozen or s.delta != "off"
            starts = self._engine is None and self.spec is not None and self.spec.starts
            where = open_dir(self.files, trainer, need, self._engine, starts, chained)
            self._dir, self._in_ram, owner = where
            self.gatherer.use_ram(self._dir if self._in_ram else None, owner)
            writer = self._is_writer(trainer)
            flags = trainer.strategy.all_gather(torch.tensor([int(writer)]))
            file_ranks = [r for r, flag in enumerate(flags.reshape(-1).tolist()) if flag]
            self.transport.setup(self._dir, self._in_ram, file_ranks, writer)
            module = None if self.gatherer.source else self.gatherer.model(pl_module)
            adapter = adapter_sync(self.spec, self._engine, module, trainer.world_size)
            self.transport.adapter = adapter
            if starts:
                assert self.spec is not None
                lora = adapter.engine_args() if adapter is not None and adapter.pushes else {}
                self._engine = self.spec.start(self._dir, trainer.num_devices, lora)
                self._owns_engine = True
                self.transport.engine = self._engine
            # in RAM the content hash only serves an engine that verifies it (an option of its)
            asked = self.spec is not None and bool(self.spec.options.bridge.get("verify_hash"))
            verifies = asked or getattr(self._engine, "verify_hash", False) is True
            self.gatherer.hashed = not self._in_ram or verifies
        _expose(pl_module, self._engine)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.enabled and stage == "fit":
            self._release(trainer, pl_module)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # Lightning skips teardown hooks when fit raises; an engine we built must still go.
        if self.enabled:
            self._release(trainer, pl_module)

    def _release(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._owns_engine and self._engine is not None:
            self._engine.close()
            self._engine = self.transport.engine = None
            self._owns_engine = False
            _expose(pl_module, None)
        if self._in_ram and self._dir is not None and self._is_writer(trainer):
            release(self._dir, self._engine.served_checkpoints if self._engine else ())
        self.gatherer.use_ram(None)  # the writer's maps of the files go too, and its hold
        self.deltas.release()

    # -- cadence -----------------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        if self._dir is not None:  # a new run: a keyframe first, in the trainer's dtype
            self.deltas.start(self._dir)
        if self.enabled and self.clock.at_train_start(step):
            self._sync(trainer, pl_module, step)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self.enabled and self.clock.at_batch_end(trainer.global_step):
            self._sync(trainer, pl_module, trainer.global_step)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.enabled and self.clock.at_train_end(trainer.global_step):
            self._sync(trainer, pl_module, trainer.global_step)

    def _is_writer(self, trainer: pl.Trainer) -> bool:
        """The rank that writes checkpoints: global rank zero, or each node's local rank zero."""
        return trainer.local_rank == 0 if self.files.node_local else trainer.is_global_zero

    # -- one sync ----------------------------------------------------------------------------

    def _sync(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        """One sync through the sender (:class:`~weight_bridge.sync.Sender`): save (every
        rank plans; the writers write), push (every rank with an engine), check.

        Each step is tried locally and agreed on by every rank (:class:`Collective`), so one
        rank's failure fails every rank at the same point and none is left waiting."""
        if self._dir is None:
            raise RuntimeError("VLLMWeightSync pushed before setup(stage='fit')")
        collective = Collective(trainer.strategy)
        adapter = self.transport.adapter
        pushes = adapter is not None and adapter.pushes  # only A and B: never a delta
        path = (adapter_dir if pushes else step_file)(self._dir, step)
        sync = SyncStep(trainer, pl_module, path, step, collective)
        last = self.clock.last_pushed_step
        turn = self.sender.turn(None if last is None else str(last), partial_only=pushes)
        failed: StepFailed | None = None
        broadcast = trainer.strategy.broadcast
        write, push = partial(self.transport.write, sync), partial(self.transport.push, sync)
        try:
            try:
                sent = self.sender.send(sync.path, turn, write, push, broadcast, not pushes)
                kept = collective.run("save", partial(self.transport.pushed, sync))
            finally:
                self.transport.end()
        except StepFailed as exc:
            failed = exc
        if failed is not None:
            self._fail(step, failed)  # outside the handler: the error's own traceback
            return
        self.clock.last_pushed_step = step
        self.last_checkpoint = kept or self.sender.last_checkpoint
        record = sync_record(step, sent, sync.gap, adapter)
        self._history.append(record)
        self._report(trainer, record, sent.report is not None)

    def _report(self, trainer: pl.Trainer, record: dict[str, Any], pushed: bool) -> None:
        """Log metrics (writer) and one line (rank zero)."""
        if self._is_writer(trainer):
            for logger in trainer.loggers:
                logger.log_metrics(sync_metrics(record), step=record["step"])
        rank_zero_info(sync_line(record, pushed))

    def _fail(self, step: int, failed: StepFailed) -> None:
        """Every rank (the sender made the next sync a keyframe): raise this rank's error (or
        say another rank failed), or warn with ``on_error="warn"``."""
        error = failed.error
        if error is None:
            error = RuntimeError(
                f"weight sync of step {step} failed on another rank ({failed.what})"
            )
        if self.on_error == "raise":
            raise error
        version = self._engine.version if self._engine is not None else None
        message = (
            f"weight_sync: {failed.what} of step {step} failed, the engine stays on version "
            f"{version}: {type(error).__name__}: {error}"
        )
        rank_zero_warn(message)


def _expose(pl_module: pl.LightningModule, engine: EngineClient | None) -> None:
    # nn.Module.__setattr__ is typed for tensors and modules; a plain attribute is what we want.
    object.__setattr__(pl_module, "vllm_engine", engine)
