"""``RanksEngine``: vLLM inside the trainer's own ranks, tensor-parallel over its world, pushed
from the trainer's live tensors.

Why: TRL's colocate mode and verl's hybrid engine run vLLM in the trainer's processes with
vLLM's external launcher. There is then no engine process to start and no file between the
trainer and the engine: both share the process, so a push writes each rank's shard straight
from the trainer's tensors (the weight loaders slice the full tensor each rank hands in), one
memory pass instead of two. The trainer's ``torch.distributed`` world (Lightning's DDP or FSDP2,
under ``torchrun`` or Lightning's own launcher) is the engine's: vLLM reuses the process group
that is already initialised.

Every guarantee of a file push holds, because a push is the same update: each rank's engine core
drives its own worker, and the cores agree over the trainer's process group
(:func:`~weight_bridge.vllm.internals.engine_core.across_engine_ranks`), so the whole update is
validated on every rank before any rank writes, a refusal on one rank is every rank's, and a
failure after a rank wrote rolls every rank back. The rollback is from a host store
(:class:`~weight_bridge.direct.undo.HostStore`): one copy of this rank's shard of the weights in
host memory (pinned on CUDA, nothing on the engine's device), brought up to date in the
background after each update landed, so a push's critical path holds no copy of the old bits.

An FSDP2 trainer's DTensors are pushed as they are: nothing is gathered before the first write.
Validation reads each rank's local shards (the ranks agree on every answer), and each tensor is
gathered only when the engine's loader asks for it, written, read back and dropped
(:mod:`weight_bridge.checkpoint.live`): a rank's extra memory during a push is about two full
tensors, not the model.

Limits vLLM's external launcher sets: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (set here), every rank
must call :meth:`RanksEngine.generate` and :meth:`RanksEngine.push` together (the callback
does), a ``vllm.LLM`` only (no ``AsyncLLM``: nothing is in flight during a push), tensor
parallelism within a node (one engine per node across nodes, vLLM's data parallel).
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Sequence
from typing import Any

from ...checkpoint import BASE_VERSION_KEY
from ...checkpoint.live import LiveCheckpoint, Published
from ..generation import Generation
from ..report import PushReport
from .colocated import ColocatedEngine


class RanksEngine(ColocatedEngine):
    """A :class:`~weight_bridge.ColocatedEngine` started in this trainer rank with vLLM's
    external launcher on the initialised ``torch.distributed`` world, tensor-parallel over a
    node's ranks (every rank starts one, together). Keywords as
    :class:`~weight_bridge.ColocatedEngine`; ``cpu_threads_bind`` (CPU backend): the cores
    each rank's worker computes on (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``, such as ``"0|1"`` for
    two ranks)."""

    def __init__(
        self, model: str | os.PathLike, cpu_threads_bind: str | None = None, **kwargs: Any
    ) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(
                "an engine in the trainer's ranks needs torch.distributed initialised (start it "
                "from a Lightning strategy's setup, or under torchrun after init_process_group)"
            )
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # what vLLM's external launcher reads (torchrun sets them; Lightning's launcher not all,
        # and a RANK inherited from a parent process would be wrong: the world says)
        os.environ["RANK"] = str(self.rank)
        os.environ.setdefault("LOCAL_RANK", str(self.rank))
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if cpu_threads_bind is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu_threads_bind)
        # tensor parallel within a node, one engine per node (vLLM's data parallel) across nodes;
        # LOCAL_WORLD_SIZE as the launcher set it (vLLM's CPU platform rewrites it in a process
        # that started an engine, and a child inherits that: the callback passes its own count)
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        tp = kwargs.setdefault("tensor_parallel_size", per_node)
        if self.world_size % tp:
            raise ValueError(f"tensor_parallel_size {tp} does not divide {self.world_size} ranks")
        if self.world_size // tp > 1:
            kwargs.setdefault("data_parallel_size", self.world_size // tp)
        kwargs["distributed_executor_backend"] = "external_launcher"
        super().__init__(model, **kwargs)

    def submit(
        self, prompts: Sequence[Any], sampling: Any = None, version: Any = None
    ) -> concurrent.futures.Future[list[Generation]]:
        """:meth:`generate` on the calling thread, its future already done: the engine runs in
        the rank's own thread, in lockstep with the other ranks (nothing is generated ahead in
        this mode), and on the CPU backend its attention kernels check the OpenMP thread count
        ``cpu_threads_bind`` set on that thread (another thread fails: ``thread_num 2 vs. 1``)."""
        done: concurrent.futures.Future[list[Generation]] = concurrent.futures.Future()
        try:
            done.set_result(self.generate(prompts, sampling, version))
        except Exception as exc:
            done.set_exception(exc)
        return done

    def push_tensors(
        self, tensors: Published, version: Any, base_version: Any = None
    ) -> PushReport:
        """Push ``tensors`` (checkpoint names -> this rank's live tensors, full or DTensors, or
        :class:`~weight_bridge.checkpoint.live.LiveTensor` s: not copied) as ``version``, on
        every rank together; ``base_version``: they are a subset, applied on top of exactly
        that version (a partial push). The same refusals, read-back and rollback as a file
        push."""
        metadata = {"version": str(version)}
        if base_version is not None:
            metadata[BASE_VERSION_KEY] = str(base_version)
        return self.push(LiveCheckpoint.of(tensors, metadata), version=version)
