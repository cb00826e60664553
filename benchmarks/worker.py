"""The benchmark's worker extension: the measurements that must run inside the engine's worker
process (the bridge itself needs no extension: it reaches its workers through its backend)."""

from __future__ import annotations

import gc
import os
import time
from typing import Any

from .delta_worker import DeltaWorkerMixin


class BenchWorkerExtension(DeltaWorkerMixin):
    """The benchmark's worker methods (``self`` is vLLM's worker).

    Methods are called by name through ``collective_rpc``, so they run inside the worker that
    holds the model in both the in-process and the multi-process engine (vLLM refuses to ship
    callables to worker processes without insecure pickling). The limits are measured here,
    in the same process, threads and memory binding as the pushes they are compared with.
    """

    model_runner: Any  # vLLM's worker's
    vllm_config: Any  # vLLM's worker's
    _bench_src: dict | None = None
    _bench_dst: dict | None = None

    def bench_pid(self) -> int:
        return os.getpid()

    def bench_reload_mode(self) -> dict:
        """vLLM's ``VLLM_RELOAD_MODE`` as this worker reads it, and whether vLLM recorded the
        checkpoint layout its direct reload needs at load (0.34+; done in direct mode)."""
        import vllm.envs as envs

        model = self.model_runner.get_model()
        return {
            "VLLM_RELOAD_MODE": getattr(envs, "VLLM_RELOAD_MODE", None),
            "layout_recorded": hasattr(model, "_ckpt_param_names"),
        }

    def bench_allocator(self, state: str) -> str:
        """Switch this worker process's allocator: ``"kept"`` (what a bridged CPU engine
        runs with, :mod:`weight_bridge.vllm.worker.allocator`) or ``"default"`` (glibc's default
        parameters, fixed); the state it is in afterwards."""
        from weight_bridge.vllm.worker import allocator

        if state == "kept":
            return allocator.keep_freed_memory()
        return allocator.default_glibc_allocator()

    def bench_plan_cache(self, forget: bool = False) -> int | None:
        """``id`` of the plan cached on the model (None: none); ``forget`` drops it first, so
        the next push plans every weight again."""
        from weight_bridge.direct.state import bridge_state

        state = bridge_state(self.model_runner.get_model())
        if forget:
            state.plan_cache = None
        return None if state.plan_cache is None else id(state.plan_cache[1])

    def bench_audit_s(self, reps: int = 21) -> float:
        """Median seconds of one address audit (:func:`weight_bridge.direct.snapshot.addresses`
        of the whole model; a push takes three)."""
        import statistics

        from weight_bridge.direct.snapshot import addresses

        model = self.model_runner.get_model()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            addresses(model)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def bench_overlap(self, overlapped: bool) -> float:
        """The overlap lever, probed on this engine's own packed linears: per linear, a write
        of its weight (a copy of the same bytes from a clone, so the values do not change)
        and its re-pack, either one after the other or with the re-pack of linear i in a
        second thread while linear i+1 is written. Seconds for every linear."""
        from concurrent.futures import ThreadPoolExecutor

        from weight_bridge.direct.state import bridge_state

        model = self.model_runner.get_model()
        modules = dict(model.named_modules())
        linears = [
            (modules[name], refresher)
            for name, refresher in bridge_state(model).refreshers.items()
            if refresher.kind == "cpu packed linear"
        ]
        sources = [module.weight.detach().clone() for module, _ in linears]
        with ThreadPoolExecutor(1) as pool:
            t0 = time.perf_counter()
            pending = None
            for (module, refresher), source in zip(linears, sources, strict=True):
                module.weight.data.copy_(source)
                if not overlapped:
                    refresher.refresh(module)
                    continue
                if pending is not None:
                    pending.result()
                pending = pool.submit(refresher.refresh, module)
            if pending is not None:
                pending.result()
            return time.perf_counter() - t0

    def bench_arm_fault(self) -> None:
        """FAULT INJECTION: the next call of the last layer's down_proj loader raises, so a push
        fails after writing started (what a rollback recovers from)."""
        model = self.model_runner.get_model()
        name = [n for n, _ in model.named_parameters() if n.endswith("mlp.down_proj.weight")][-1]
        param = dict(model.named_parameters())[name]
        original = param.weight_loader

        def faulty(*args, **kwargs):
            param.weight_loader = original
            raise RuntimeError(f"benchmark fault in the weight loader of {name}")

        param.weight_loader = faulty

    def bench_prepare_limits(self, path: str) -> int:
        """In-memory copies of ``path``'s tensors and preallocated (touched) targets."""
        import torch

        from weight_bridge.checkpoint import CheckpointReader

        with CheckpointReader(path) as reader:
            self._bench_src = {name: t.clone() for name, t in reader.tensors()}
        self._bench_dst = {n: torch.zeros_like(t) for n, t in self._bench_src.items()}
        return sum(t.nbytes for t in self._bench_src.values())

    def bench_free_limits(self) -> None:
        self._bench_src = self._bench_dst = None
        gc.collect()

    def bench_copy(self) -> float:
        """Limit 1: ``copy_`` of every tensor between preallocated tensors."""
        src, dst = self._bench_src, self._bench_dst
        assert src is not None and dst is not None, "bench_prepare_limits first"
        t0 = time.perf_counter()
        for name, t in src.items():
            dst[name].copy_(t)
        return time.perf_counter() - t0

    def bench_read_copy(self, path: str) -> float:
        """Limit 2: open the file (mmap views of the page cache), copy every tensor out."""
        from weight_bridge.checkpoint import CheckpointReader

        dst = self._bench_dst
        assert dst is not None, "bench_prepare_limits first"
        t0 = time.perf_counter()
        with CheckpointReader(path) as reader:
            for name, t in reader.tensors():
                dst[name].copy_(t)
        return time.perf_counter() - t0

    def bench_layerwise_iter(self, path: str) -> float:
        """vLLM's layerwise ``reload_weights`` fed an iterator over the same mmap'd file."""
        from weight_bridge.checkpoint import CheckpointReader

        t0 = time.perf_counter()
        with CheckpointReader(path) as reader:
            self.reload_weights(  # type: ignore[attr-defined]
                weights_iterator=reader.tensors(), is_checkpoint_format=True
            )
        return time.perf_counter() - t0

    def bench_layerwise_file(self, model_dir: str) -> float:
        """vLLM's layerwise ``reload_weights(weights_path=...)``: vLLM reads the directory.

        vLLM repoints ``model_config.model`` at ``weights_path``; it is restored after.
        """
        configs = {id(self.vllm_config.model_config): self.vllm_config.model_config}
        runner = getattr(self.model_runner, "vllm_config", None)
        if runner is not None:
            configs[id(runner.model_config)] = runner.model_config
        saved = {k: (c.model, c.model_weights, c.revision) for k, c in configs.items()}
        t0 = time.perf_counter()
        try:
            self.reload_weights(  # type: ignore[attr-defined]
                weights_path=model_dir, is_checkpoint_format=True
            )
        finally:
            for k, c in configs.items():
                c.model, c.model_weights, c.revision = saved[k]
        return time.perf_counter() - t0

    def bench_naive_loop(self, path: str) -> float:
        """What RL libraries commonly do: ``model.load_weights([(name, tensor)])`` per tensor."""
        from weight_bridge.checkpoint import CheckpointReader

        model = self.model_runner.get_model()
        t0 = time.perf_counter()
        with CheckpointReader(path) as reader:
            for name, t in reader.tensors():
                model.load_weights([(name, t)])
        return time.perf_counter() - t0


BENCH_EXTENSION = f"{__name__}.BenchWorkerExtension"
