"""``VLLMWeightSync``: a Lightning callback that keeps a colocated vLLM engine on the live policy.

On-policy RL loops generate with the weights being trained. Instead of a weight-transfer
protocol, the callback saves the module's weights as one safetensors checkpoint (atomic, hashed)
and pushes it into a :class:`~weight_bridge.vllm.ColocatedEngine`, which copies the bytes in place
into its live storage. A checkpoint on disk is also what a cold start would load, so what the
engine serves after a push is exactly what a fresh engine on that file would serve.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from weight_bridge.checkpoint import BASE_VERSION_KEY, save_checkpoint
from weight_bridge.vllm.engine import ColocatedEngine

from .canary import CanaryError, default_probe, logprob_gap
from .changed import sync_state
from .names import CheckpointNames
from .retention import prune, release, sync_dir

__all__ = ["VLLMWeightSync"]

_OFF = {"0", "false", "off", "no"}
_ON = {"1", "true", "on", "yes"}


class VLLMWeightSync(Callback):
    """Push the trained weights into a colocated vLLM engine every few optimizer steps.

    The engine is either passed in (``engine``) or built in :meth:`setup` from ``model_path``
    and ``engine_kwargs`` (then closed in :meth:`teardown`). Either way :meth:`setup` exposes it
    as ``pl_module.vllm_engine``, so a rollout in ``training_step`` reads::

        outputs = self.vllm_engine.generate(prompts, sampling_params)
        # outputs[i].policy_version == the global step whose weights produced them

    Cadence counts optimizer steps (``trainer.global_step``), so gradient accumulation does not
    change it: a push happens when the step advanced to one that is due (``every_n_train_steps``
    and/or ``at_steps``), before the first step (``push_on_train_start``; version = the current
    step), and at the end (``push_on_train_end``). No step is pushed twice in one run. The
    engine version is the global step. A run resumed from a checkpoint (or starting past step
    0) always pushes its restored weights on train start, since the engine would otherwise
    serve the weights it was started with.

    Each sync gathers ``getattr(pl_module, module_attr).state_dict()`` (``module_attr=""``:
    the whole LightningModule through the strategy, which also gathers sharded states; or
    ``source(pl_module)``) on every rank, renames it to Hugging Face names (``strip_prefix``,
    then each ``rename`` regex in order), writes tied tensors once, optionally casts floating
    tensors to ``dtype``, and global rank zero writes ``step-{step:08d}.safetensors`` under
    ``dirpath`` (default ``<trainer.log_dir>/weight_sync``; ``ram_dir=True``: a private
    directory in ``/dev/shm``, removed at teardown). Then every rank pushes into its own engine,
    if it has one. After a successful push, checkpoints beyond the newest ``keep_last_k`` are
    deleted, except the one an engine serves.

    ``node_local=True`` is the multi-node layout: each node's local rank zero writes its own copy
    into ``<dir>/node<node_rank>`` (a node-local disk or ``/dev/shm`` at the same path on every
    node) and every rank pushes from its own node's copy, so no node waits on another node's disk.

    ``enabled=False`` (or the ``env_var`` set to 0/false/off; 1/true/on forces it on) turns the
    callback into a no-op: no files, no engine, ``pl_module.vllm_engine`` is None.
    ``on_error="warn"`` turns a failed save or push into a warning and keeps the engine on the
    last good version (re-pushing it if the failure left the engine's weights half-written).

    Only ``fit`` builds an engine and pushes; other stages see a passed-in engine as it is.
    ``env_var`` is read when the callback is constructed. Under ``ddp_spawn`` pass
    ``model_path``: each rank then builds its own engine, and nothing unpicklable (an engine, a
    lambda ``source``) has to travel to the ranks.
    ``canary=True`` (or ``canary_prompts``, lists of token ids) checks every push end to end:
    the trainer's model (``module_attr``) and the engine score the same probe batch and the
    largest logprob difference is logged as ``weight_sync/canary_gap``; above
    ``canary_tolerance`` the sync fails (:class:`~callbacks.canary.CanaryError`, or a warning
    with ``on_error="warn"``). It catches what the bridge's own proofs cannot: derived state it
    does not know, names mapped onto the wrong weights (see :mod:`callbacks.canary`).
    Metrics ``weight_sync/{save_s,push_s,bytes,version}`` go to the trainer's loggers.

    Only what can change is sent (``skip_frozen=True``, see :mod:`callbacks.changed`): after a
    complete first push (on train start, on resume, after any failed sync, and every
    ``full_every_k``-th sync if set), a sync saves a *partial* checkpoint holding only the
    parameters that require grad, the buffers, and the merged weight of each PEFT LoRA layer,
    applied by the engine on top of the version it serves. PEFT-wrapped modules are always
    pushed under the base model's names with their adapters merged, partial or not.
    """

    def __init__(
        self,
        engine: ColocatedEngine | None = None,
        model_path: str | None = None,
        engine_kwargs: dict | None = None,
        every_n_train_steps: int | None = 1,
        at_steps: list[int] | None = None,
        push_on_train_start: bool = True,
        push_on_train_end: bool = True,
        module_attr: str = "model",
        source: Callable | None = None,
        strip_prefix: str = "",
        rename: dict[str, str] | None = None,
        dtype: str | None = None,
        dirpath: str | None = None,
        ram_dir: bool = False,
        keep_last_k: int = 2,
        enabled: bool = True,
        env_var: str = "WEIGHT_BRIDGE_SYNC",
        on_error: str = "raise",
        verify_hash: bool = True,
        node_local: bool = False,
        canary: bool = False,
        canary_prompts: list[list[int]] | None = None,
        canary_tolerance: float = 1e-3,
        skip_frozen: bool = True,
        full_every_k: int | None = None,
    ) -> None:
        if every_n_train_steps is not None and every_n_train_steps < 1:
            raise ValueError(f"every_n_train_steps must be >= 1 or None, not {every_n_train_steps}")
        if at_steps is not None and any(s < 0 for s in at_steps):
            raise ValueError(f"at_steps must be non-negative, not {at_steps}")
        if keep_last_k < 1:
            raise ValueError(f"keep_last_k must be >= 1, not {keep_last_k}")
        if full_every_k is not None and full_every_k < 1:
            raise ValueError(f"full_every_k must be >= 1 or None, not {full_every_k}")
        if canary_tolerance <= 0:
            raise ValueError(f"canary_tolerance must be positive, not {canary_tolerance}")
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error must be 'raise' or 'warn', not {on_error!r}")
        self.env_var = env_var
        self.enabled = _resolve_enabled(enabled, env_var)
        if self.enabled and engine is None and model_path is None:
            raise ValueError("VLLMWeightSync needs an engine or a model_path to build one from")
        if engine is not None and model_path is not None:
            raise ValueError("pass either an engine or a model_path, not both")
        self._engine = engine
        self._owns_engine = False
        self.model_path = model_path
        self.engine_kwargs = dict(engine_kwargs or {})
        self.every_n_train_steps = every_n_train_steps
        self.at_steps = sorted(set(at_steps or ()))
        self.push_on_train_start = push_on_train_start
        self.push_on_train_end = push_on_train_end
        self.module_attr = module_attr
        self.source = source
        self.strip_prefix = strip_prefix
        self.rename = dict(rename or {})
        self.dtype = dtype
        self._names = CheckpointNames(strip_prefix, self.rename, dtype)
        self.dirpath = dirpath
        self.ram_dir = ram_dir
        self.keep_last_k = keep_last_k
        self.on_error = on_error
        self.verify_hash = verify_hash
        self.node_local = node_local
        self.canary = canary or canary_prompts is not None
        self.canary_prompts = canary_prompts
        self.canary_tolerance = canary_tolerance
        self.skip_frozen = skip_frozen
        self.full_every_k = full_every_k
        self._partials_in_row: int | None = None  # None: the next sync must be complete
        self.last_pushed_step: int | None = None
        self.last_checkpoint: str | None = None
        self.history: list[dict[str, Any]] = []
        self._dir: Path | None = None
        self._seen_step: int | None = None

    @property
    def engine(self) -> ColocatedEngine | None:
        """The engine pushed into (None when disabled or not built yet)."""
        return self._engine

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(module_attr=self.module_attr)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"last_pushed_step": self.last_pushed_step, "last_checkpoint": self.last_checkpoint}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_pushed_step = state_dict.get("last_pushed_step")
        self.last_checkpoint = state_dict.get("last_checkpoint")

    # -- lifetime ----------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not self.enabled:
            _expose(pl_module, None)
            return
        if stage == "fit":
            if self._engine is None and self.model_path is not None:
                self._engine = ColocatedEngine(self.model_path, **self.engine_kwargs)
                self._owns_engine = True
            where = sync_dir(
                self.ram_dir, self.dirpath, trainer.log_dir or trainer.default_root_dir
            )
            self._dir = Path(trainer.strategy.broadcast(str(where)))
            if self.node_local:
                self._dir = self._dir / f"node{trainer.node_rank}"
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
        if self.ram_dir and self._dir is not None and self._is_writer(trainer):
            release(self._dir, self._engine.served_checkpoints if self._engine else ())

    # -- cadence -----------------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.enabled:
            return
        step = trainer.global_step
        self._seen_step = step
        self._partials_in_row = None
        resumed = step > 0 or trainer.ckpt_path is not None
        if self.push_on_train_start or resumed or step in self.at_steps:
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
        if not self.enabled:
            return
        step = trainer.global_step
        advanced = step != self._seen_step
        self._seen_step = step
        if advanced and self._due(step) and step != self.last_pushed_step:
            self._sync(trainer, pl_module, step)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.enabled and self.push_on_train_end and trainer.global_step != self.last_pushed_step:
            self._sync(trainer, pl_module, trainer.global_step)

    def _is_writer(self, trainer: pl.Trainer) -> bool:
        """The rank that writes checkpoints: global rank zero, or each node's local rank zero."""
        return trainer.local_rank == 0 if self.node_local else trainer.is_global_zero

    def _due(self, step: int) -> bool:
        n = self.every_n_train_steps
        return (n is not None and step % n == 0) or step in self.at_steps

    # -- one sync ----------------------------------------------------------------------------

    def _sync(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        """Gather (all ranks), write (rank 0), push (every rank with an engine), prune.

        Every collective call is made by every rank whatever happens locally, and the ranks
        agree on success before going on, so one rank's failure cannot leave the others waiting.
        """
        if self._dir is None:
            raise RuntimeError("VLLMWeightSync pushed before setup(stage='fit')")
        strategy = trainer.strategy
        path = self._dir / f"step-{step:08d}.safetensors"
        error: BaseException | None = None
        nbytes = 0
        started = time.perf_counter()
        partial = False
        try:
            tensors, source_dtype, partial = self._gather(trainer, pl_module)
            if self._is_writer(trainer):
                metadata = {
                    "step": str(step),
                    "version": str(step),
                    "source_dtype": source_dtype,
                }
                if partial:
                    metadata[BASE_VERSION_KEY] = str(self.last_pushed_step)
                nbytes = save_checkpoint(tensors, path, metadata).bytes
            del tensors
        except Exception as exc:
            error = exc
        save_s = time.perf_counter() - started
        if not strategy.reduce_boolean_decision(error is None, all=True):
            self._fail(step, "save", error)
            return
        if not self.node_local:
            path = Path(strategy.broadcast(str(path), src=0))

        report = None
        started = time.perf_counter()
        if self._engine is not None:
            try:
                report = self._engine.push(path, version=step, verify_hash=self.verify_hash)
            except Exception as exc:
                error = exc
                self._recover()
        push_s = time.perf_counter() - started
        if not strategy.reduce_boolean_decision(error is None, all=True):
            self._fail(step, "push", error)
            return
        gap = None
        if self.canary and self._engine is not None:
            try:
                gap = self._canary_gap(pl_module)
            except Exception as exc:
                error = exc
        if not strategy.reduce_boolean_decision(error is None, all=True):
            self._fail(step, "canary", error)
            return

        self.last_pushed_step = step
        self.last_checkpoint = str(path)
        self._partials_in_row = (self._partials_in_row or 0) + 1 if partial else 0
        record = {
            "step": step,
            "checkpoint": str(path),
            "bytes": nbytes,
            "partial": partial,
            "save_s": save_s,
            "push_s": push_s,
            "mode": report.mode if report is not None else None,
            "canary_gap": gap,
        }
        self.history.append(record)
        if self._is_writer(trainer):
            served = self._engine.served_checkpoints if self._engine is not None else []
            assert self._dir is not None
            prune(self._dir, path, self.keep_last_k, served)
            metrics = {
                "weight_sync/save_s": save_s,
                "weight_sync/push_s": push_s,
                "weight_sync/bytes": float(nbytes),
                "weight_sync/version": float(step),
            }
            if gap is not None:
                metrics["weight_sync/canary_gap"] = gap
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
        mode = f", {report.mode}" if report is not None else ", no engine on rank 0"
        mode += ", partial" if partial else ""
        rank_zero_info(
            f"weight_sync: step {step} -> {path.name} ({nbytes / 2**20:.1f} MiB, "
            f"save {save_s:.2f} s, push {push_s:.2f} s{mode})"
        )

    def _gather(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> tuple[dict[str, torch.Tensor], str, bool]:
        """The tensors to save, their source dtype, and whether they are a partial set."""
        root: torch.nn.Module | None = None
        if self.source is not None:
            state: Mapping[str, Any] = self.source(pl_module)
        elif self.module_attr:
            root = getattr(pl_module, self.module_attr)
            state = root.state_dict()
        else:
            root = pl_module
            state = trainer.strategy.lightning_module_state_dict()
        if not self._is_writer(trainer):
            return {}, "", False  # the state dict call above may be collective; writers save
        changing = sync_state(root, state, changing_only=self._partial_due())
        tensors, source_dtype = self._names.checkpoint_tensors(changing)
        return tensors, source_dtype, changing.partial

    def _partial_due(self) -> bool:
        """Whether this sync may leave out what cannot change (see the class docstring)."""
        if not self.skip_frozen or self._partials_in_row is None:
            return False
        return self.full_every_k is None or self._partials_in_row + 1 < self.full_every_k

    def _canary_gap(self, pl_module: pl.LightningModule) -> float:
        model = getattr(pl_module, self.module_attr) if self.module_attr else pl_module
        probe = self.canary_prompts
        if probe is None:
            probe = default_probe(int(getattr(model.config, "vocab_size", 256)))
        gap = logprob_gap(model, self._engine, probe)
        if gap > self.canary_tolerance:
            raise CanaryError(
                f"after the push the engine's logprobs differ from the trainer's by {gap:.3g} "
                f"(canary_tolerance={self.canary_tolerance:g}): the engine does not compute "
                "what the trainer computes"
            )
        return gap

    def _recover(self) -> None:
        """After a failed push in warn mode, put half-written weights back to the last good
        version (its complete checkpoint, then the partial ones on top of it)."""
        engine = self._engine
        if self.on_error != "warn" or engine is None or engine.undefined is None:
            return
        chain = engine.served_checkpoints
        try:
            for path in chain:
                engine.push(path)
        except Exception as exc:
            message = f"weight_sync: restoring {chain} failed: {exc}"
            warnings.warn(message, stacklevel=2)

    def _fail(self, step: int, what: str, error: BaseException | None) -> None:
        self._partials_in_row = None  # the next sync is complete
        if error is None:
            error = RuntimeError(f"weight sync of step {step} failed on another rank ({what})")
        if self.on_error == "raise":
            raise error
        version = self._engine.version if self._engine is not None else None
        message = (
            f"weight_sync: {what} of step {step} failed, the engine stays on version {version}: "
            f"{type(error).__name__}: {error}"
        )
        rank_zero_warn(message)


def _expose(pl_module: pl.LightningModule, engine: ColocatedEngine | None) -> None:
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
