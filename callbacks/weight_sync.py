"""``VLLMWeightSync``: a Lightning callback that keeps a colocated vLLM engine on the live policy.

On-policy RL loops generate with the weights being trained. Instead of a weight-transfer
protocol, the callback saves the module's weights as one safetensors checkpoint (streamed,
atomic, hashed) and pushes it into an engine, which copies the bytes in place into its live
storage. A checkpoint on disk is also what a cold start would load, so what the engine serves
after a push is exactly what a fresh engine on that file would serve.

The callback only wires the parts together: :class:`~callbacks.schedule.SyncClock` decides when
(and whether a sync is complete, partial or a delta), :class:`~callbacks.gather.Gatherer` what
is sent and how each tensor reaches the writer (DTensors of sharded trainers one at a time),
:class:`~weight_bridge.checkpoint.delta_state.DeltaState` what the engine reported and the
writer's reference copy, :class:`~callbacks.collective.Collective` makes each step fail on every
rank or none, and the engine (any :class:`~weight_bridge.vllm.clients.bridge_client.EngineClient`)
is pushed.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from weight_bridge.checkpoint import (
    BASE_VERSION_KEY,
    CheckpointFiles,
    DeltaState,
    release,
    step_file,
)
from weight_bridge.vllm import ENGINE_MODES, EngineClient, client_for, connect, start_engine

from .canary import CanaryCheck
from .collective import Collective, StepFailed
from .directory import open_dir
from .gather import Gatherer
from .names import ENGINE, CheckpointNames
from .records import Saved, sync_line, sync_metrics, sync_record
from .schedule import Schedule, SyncClock

__all__ = ["VLLMWeightSync"]

_OFF = {"0", "false", "off", "no"}
_ON = {"1", "true", "on", "yes"}


class VLLMWeightSync(Callback):
    """Push the trained weights into a colocated vLLM engine every few optimizer steps.

    Args:
        engine: the engine to push into (any :class:`~weight_bridge.EngineClient`, or a
            ``vllm.LLM`` started with the ``weight_bridge`` backend), or
        engine_url: a ``vllm serve`` process running the backend, whose checkpoint root holds
            ``files.dirpath`` (pushed over HTTP), or
        model_path: a model directory to build an engine from in :meth:`setup` (with
            ``engine_kwargs``, ``engine_mode`` and ``inflight``: :func:`~weight_bridge.vllm.
            engines.start_engine`; closed in :meth:`teardown`), reading checkpoints from the sync's
            directory only. Under ``ddp_spawn`` pass this: each rank builds its own engine.
        schedule: when to sync, when a sync must be complete, and deltas (:class:`Schedule`).
        files: where checkpoints go and how many are kept (:class:`CheckpointFiles`).
        names: checkpoint names and dtype (:class:`CheckpointNames`; by default each tensor in
            the dtype the engine holds it in, once the engine said).
        module_attr: the LightningModule attribute holding the model (``""``: the module
            itself); ``source``: a callable ``pl_module -> state dict`` instead.
        canary: check every push end to end (:class:`~callbacks.canary.CanaryCheck`; ``True``:
            with defaults); the logprob gap is logged as ``weight_sync/canary_gap``.
        enabled: ``False`` (or ``env_var`` set to 0/false/off; 1/true/on forces it on, read at
            construction) makes the callback a no-op: no files, no engine.
        on_error: ``"raise"``, or ``"warn"``: a failed save, push or canary becomes a warning
            and the engine stays on the last good version (it rolls a failed push back itself);
            the next sync is complete.
        verify_hash: the engine recomputes each checkpoint's content hash (always in the
            header) before writing; off by default, see docs/sync.md for why that is sound.

    Either way :meth:`setup` exposes the engine as ``pl_module.vllm_engine``, so a rollout in
    ``training_step`` reads ``self.vllm_engine.generate(prompts, sampling)``, any engine mode; each
    ``Generation``'s ``policy_version`` is the step pushed, a string. Every sync, the ranks plan the
    checkpoint from metadata, the writer (global rank zero, or each node's local rank zero with
    ``files.node_local``) streams it to ``step-{step:08d}.safetensors``, and every rank with an
    engine pushes it. Sharded trainers (FSDP2 via ``ModelParallelStrategy``) gather one tensor at
    a time, every rank taking part. With deltas (``schedule.delta``) a sync between keyframes
    writes only the values that changed (:mod:`weight_bridge.checkpoint.delta_state`). Only
    ``fit`` builds an engine and pushes. Metrics (to the trainer's loggers):
    ``weight_sync/{save_s,push_s,bytes,version,delta}`` (and ``changed_fraction`` for a delta);
    ``history`` holds the last ``history_limit`` syncs (:func:`~callbacks.records.sync_record`).
    """

    history_limit = 256

    def __init__(
        self,
        engine: EngineClient | Any = None,
        model_path: str | None = None,
        engine_kwargs: dict | None = None,
        engine_mode: str = "colocated",
        engine_url: str | None = None,
        inflight: str | None = "recompute",
        schedule: Schedule = Schedule(),  # noqa: B008 (frozen: shared safely)
        files: CheckpointFiles = CheckpointFiles(),  # noqa: B008
        names: CheckpointNames = CheckpointNames(),  # noqa: B008
        module_attr: str = "model",
        source: Callable | None = None,
        canary: CanaryCheck | bool | None = None,
        enabled: bool = True,
        env_var: str = "WEIGHT_BRIDGE_SYNC",
        on_error: str = "raise",
        verify_hash: bool = False,
    ) -> None:
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error must be 'raise' or 'warn', not {on_error!r}")
        check = CanaryCheck() if canary is True else (canary or None)
        self.env_var = env_var
        self.enabled = _resolve_enabled(enabled, env_var)
        given = [x is not None for x in (engine, model_path, engine_url)]
        if self.enabled and not any(given):
            raise ValueError(
                "VLLMWeightSync needs an engine, an engine_url or a model_path to build one from"
            )
        if sum(given) > 1:
            raise ValueError("pass one of engine, engine_url and model_path")
        if engine_mode not in ENGINE_MODES:
            raise ValueError(f"engine_mode must be one of {ENGINE_MODES}, not {engine_mode!r}")
        self._engine = client_for(engine) if engine is not None else None
        if engine_url is not None:
            self._engine = connect(engine_url, inflight)
        self._owns_engine = False
        self.model_path = model_path
        self.engine_kwargs = dict(engine_kwargs or {})
        self.engine_mode = engine_mode
        self.inflight = inflight
        self.files = files
        self.canary = check
        self.on_error = on_error
        self.verify_hash = verify_hash
        self.clock = SyncClock(schedule)
        self.gatherer = Gatherer(names, module_attr, source, fsync=files.durable)
        self.deltas = DeltaState(self.clock, self.gatherer.engine, names.dtype == ENGINE)
        self.last_checkpoint: str | None = None
        self._history: deque[dict[str, Any]] = deque(maxlen=self.history_limit)
        self._dir: Path | None = None
        self._in_ram = False
        self._writers: list[int] = [0]

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
            partial = s.skip_frozen or s.delta != "off"
            where = open_dir(self.files, trainer, need, self._engine, self.model_path, partial)
            self._dir, self._in_ram, owner = where
            self.gatherer.use_ram(self._dir if self._in_ram else None, owner)
            self.gatherer.hashed = self.verify_hash or not self._in_ram  # RAM: hash to check only
            flags = trainer.strategy.all_gather(torch.tensor([int(self._is_writer(trainer))]))
            self._writers = [r for r, flag in enumerate(flags.reshape(-1).tolist()) if flag]
            if self._engine is None and self.model_path is not None:
                kwargs = {"checkpoint_root": str(self._dir), **self.engine_kwargs}
                mode, inflight = self.engine_mode, self.inflight
                self._engine = start_engine(self.model_path, mode, inflight, **kwargs)
                self._owns_engine = True
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
            self._engine = None
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
        resumed = step > 0 or trainer.ckpt_path is not None
        if self._dir is not None:  # a new run: a keyframe first, in the trainer's dtype
            self.deltas.start(self._dir)
        if self.enabled and self.clock.at_train_start(step, resumed):
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
        """Save (every rank plans; the writers write), push (every rank with an engine), check.

        Each step is tried locally and agreed on by every rank (:class:`Collective`), so one
        rank's failure fails every rank at the same point and none is left waiting."""
        if self._dir is None:
            raise RuntimeError("VLLMWeightSync pushed before setup(stage='fit')")
        collective = Collective(trainer.strategy)
        path = step_file(self._dir, step)
        times = [time.perf_counter()]
        failed: StepFailed | None = None
        saved = None
        try:
            saved = collective.run(
                "save", lambda: self._save(trainer, pl_module, path, step, collective)
            )
            saved = trainer.strategy.broadcast(saved, src=0)
            path = path if self.files.node_local else Path(saved.path)
            times.append(time.perf_counter())
            report = collective.run("push", lambda: self._push(path, step))
            times.append(time.perf_counter())
            gap = collective.run("canary", lambda: self._canary_gap(pl_module))
        except StepFailed as exc:
            failed = exc
        if failed is not None or saved is None:
            if saved is not None and self._is_writer(trainer):  # a failed sync leaves no file
                self.gatherer.discard(path, self._engine)
            self._fail(step, failed)  # outside the handler: the error's own traceback
            return
        reported = (dict(getattr(report, "dtypes", None) or {}), times[2] - times[0])
        dtypes, seconds = trainer.strategy.broadcast(reported, src=0)  # every rank: rank 0's
        self.clock.synced(step, saved.partial, saved.delta, saved.nbytes, saved.based, seconds)
        kind = "delta" if saved.delta else "partial" if saved.partial else "complete"
        self.deltas.pushed(kind, dtypes)
        if kind == "complete":  # loadable on its own: vLLM and transformers start on it
            self.last_checkpoint = str(path)
        record = sync_record(step, path, saved, times, report, gap)
        self._history.append(record)
        self._report(trainer, record, report is not None)

    def _save(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        path: Path,
        step: int,
        collective: Collective,
    ) -> Saved:
        """Plan the checkpoint (every rank) and stream it (writers; sharded: every rank): a
        delta between keyframes when deltas run, else complete or partial."""
        writer = self._is_writer(trainer)
        kind, based = self.deltas.kind()
        changing = kind == "partial" or (kind == "delta" and self.schedule.skip_frozen)
        plan = self.gatherer.plan(trainer, pl_module, changing, writer, based and kind != "delta")
        metadata = {"step": str(step), "version": str(step), "source_dtype": plan.source_dtype}
        if plan.partial or kind == "delta":
            metadata[BASE_VERSION_KEY] = str(self.clock.last_pushed_step)
        where = path if writer else None
        sink = self.gatherer.opener(self.deltas, kind, based, plan)
        saved = self.gatherer.stream(plan, where, metadata, collective, self._writers, sink)
        delta, changed = kind == "delta", self.deltas.changed_fraction()
        nbytes, why = saved.bytes if saved else 0, self.deltas.why(kind)  # why: for the record
        return Saved(nbytes, plan.partial, str(path), delta, changed, based, why)

    def _push(self, path: Path, step: int) -> Any:
        if self._engine is None:
            return None
        return self._engine.push(path, version=step, verify_hash=self.verify_hash)

    def _canary_gap(self, pl_module: pl.LightningModule) -> float | None:
        if self.canary is None or self._engine is None:
            return None
        return self.canary.gap(self.gatherer.model(pl_module), self._engine)

    def _report(self, trainer: pl.Trainer, record: dict[str, Any], pushed: bool) -> None:
        """Prune old files, log metrics (writer) and one line (rank zero)."""
        path = Path(record["checkpoint"])
        if self._is_writer(trainer):
            served = self._engine.served_checkpoints if self._engine is not None else []
            assert self._dir is not None
            self.gatherer.retire(self._dir, path, self.files.keep(self._in_ram), served)
            for logger in trainer.loggers:
                logger.log_metrics(sync_metrics(record), step=record["step"])
        rank_zero_info(sync_line(record, pushed))

    def _fail(self, step: int, failed: StepFailed | None) -> None:
        """Every rank: the next sync is complete (a keyframe: the reference copy is not trusted);
        then raise this rank's error (or say another rank failed), or warn with
        ``on_error="warn"``."""
        self.deltas.failed()  # the clock (a keyframe next) and the reference copy
        assert failed is not None
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


def _resolve_enabled(enabled: bool, env_var: str) -> bool:
    raw = os.environ.get(env_var, "").strip().lower()
    if raw in _OFF:
        return False
    if raw in _ON:
        return True
    if raw:
        rank_zero_warn(f"ignoring {env_var}={raw!r}: expected one of {sorted(_ON | _OFF)}")
    return enabled
