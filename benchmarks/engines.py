"""The engines measured (the bridge's, vLLM's own), the calls on them, and the benchmark's
worker extension (called by name through ``collective_rpc``: inside the worker process)."""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from weight_bridge.checkpoint import BASE_VERSION_KEY, CheckpointReader, save_checkpoint
from weight_bridge.delta.format import read_delta
from weight_bridge.direct.delta import modules_to_refresh
from weight_bridge.direct.derived import refresh_derived_state
from weight_bridge.direct.snapshot import addresses
from weight_bridge.direct.state import bridge_state
from weight_bridge.direct.undo import UndoLog
from weight_bridge.direct.write_map import held_tensor
from weight_bridge.exact import bits_of, exact_fingerprint, format_fingerprint
from weight_bridge.testing import parity

from .harness import ENGINE_KWARGS, PARITY_PROMPTS, PARITY_TOKENS, tensors_of, timed

# fmt: off
EXTENSION, GEN_BATCH = "benchmarks.engines.BenchWorkerExtension", 8

def start_engine(model: Path, root: Path | None = None, **kwargs: Any) -> Any:
    """A bridged engine; pushes read under ``root`` (default: where the model's directory is)."""
    from weight_bridge import ColocatedEngine
    return ColocatedEngine(model, checkpoint_root=root or Path(model).parent,
                           worker_extension_cls=EXTENSION, **{**ENGINE_KWARGS, **kwargs})

class StockEngine:
    """vLLM's ``LLM`` as vLLM ships it (the plugin leaves it alone), the same arguments."""

    def __init__(self, model: Path, **kwargs: Any) -> None:
        from vllm import LLM
        t0, kwargs = time.perf_counter(), {**ENGINE_KWARGS, **kwargs}
        self.llm = LLM(model=str(model), worker_extension_cls=EXTENSION, **kwargs)
        self.startup_s = time.perf_counter() - t0

    def generate(self, prompts: Any, sampling_params: Any = None) -> list:
        from weight_bridge.vllm.generation import Generation
        top = getattr(sampling_params, "logprobs", None)
        outputs = self.llm.generate(prompts, sampling_params, use_tqdm=False)
        return [Generation.from_request_output(o, top) for o in outputs]

    def close(self) -> None:
        from weight_bridge.vllm.internals.engine_client import shutdown
        if self.llm is not None:
            llm, self.llm = self.llm, None
            shutdown(llm)

def greedy(engine: Any, max_tokens: int = PARITY_TOKENS) -> list:
    return parity.greedy(engine, PARITY_PROMPTS, max_tokens, logprobs=3, ignore_eos=True)

def generation_rate(engine: Any, tokens: int) -> float:
    """Tokens/s of one fixed greedy batch (``GEN_BATCH`` prompts, prefill included)."""
    from vllm import SamplingParams

    from weight_bridge import token_prompts
    prompts = token_prompts([[1, 10 + i, 20 + i, 30 + i, 40 + i] for i in range(GEN_BATCH)])
    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0,
                                                   ignore_eos=True))
    return sum(len(g.completions[0].token_ids) for g in outs) / (time.perf_counter() - t0)

def push(engine: Any, ckpt: Path, version: Any, check_finite: bool = True, verify: bool = False,
         readback: str = "sampled", mode: str = "direct") -> dict[str, float]:
    """One ``ColocatedEngine.push`` and its report's split; ``mode``: the way it must go."""
    if readback != "sampled":  # the engine's default, put back after
        engine.readback = readback
    try:
        report = engine.push(ckpt, version=version, verify_hash=verify, check_finite=check_finite)
    finally:
        if readback != "sampled":
            engine.readback = "sampled"
    if report.mode != mode:
        raise RuntimeError(f"push went {report.mode}: {report.reason}")
    parts = {"read_s": report.preflight_s, "write_s": report.write_s,
             "refresh_s": report.refresh_s, "readback_s": report.readback_s}
    # the rest: the RPCs, the checkpoint's headers, the address audit, the prefix-cache reset
    rest = report.elapsed_s - sum(parts.values())
    return {"elapsed_s": report.elapsed_s, **parts, "overhead_s": rest}

def rpc_all(engine: Any, method: str, *args: Any) -> list:
    return list(engine.llm.collective_rpc(method, args=args))

def rpc(engine: Any, method: str, *args: Any) -> float:
    return max(rpc_all(engine, method, *args))

def rpc_reload(engine: Any, method: str, arg: Any) -> dict[str, float]:
    """A reload by another path, timed like a push: the call plus the prefix-cache reset."""
    t0, inner = time.perf_counter(), rpc(engine, method, str(arg))
    engine.llm.reset_prefix_cache()
    return {"elapsed_s": time.perf_counter() - t0, "inner_s": inner}

def api_reload(engine: Any, folder: str | Path) -> dict[str, float]:
    """vLLM's own checkpoint-format reload through its API, as RL libraries call it, plus the
    prefix-cache reset a push also pays."""
    t0, kwargs = time.perf_counter(), {"weights_path": str(folder), "is_checkpoint_format": True}
    engine.llm.collective_rpc("reload_weights", kwargs=kwargs)
    engine.llm.reset_prefix_cache()
    return {"elapsed_s": time.perf_counter() - t0}

def alternate(b: Any, a: Any) -> Callable[[int], Any]:
    """Round ``rep``'s load: ``b`` on even rounds, ``a`` on odd ones (each changes every value)."""
    return lambda rep: b if rep % 2 == 0 else a

def tiny_files(a: Path, tag: str) -> Callable[[str], Path]:
    """``file(base)``: a partial checkpoint of the final norm (from A) on version ``base``."""
    tensor = tensors_of(a / "model.safetensors", lambda n: n.endswith("model.norm.weight"))
    root = a.parent / f"tiny-{tag}-{a.name}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)

    def file(base: str) -> Path:
        if not (path := root / f"tiny-on-{base}.safetensors").exists():
            save_checkpoint(tensor, path, {BASE_VERSION_KEY: base})
        return path
    return file

def server_args() -> list[str]:
    k = ENGINE_KWARGS
    return ["--dtype", str(k["dtype"]), "--max-model-len", str(k["max_model_len"]), "--seed",
            str(k["seed"]), "--max-num-seqs", str(k["max_num_seqs"]),
            *(["--enforce-eager"] if k.get("enforce_eager") else [])]

def _same(a: Any, b: Any) -> bool:
    return torch.equal(bits_of(a.detach()), bits_of(b.detach()))

def _view(t: Any) -> tuple:
    return t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype

def _patches(path: str) -> tuple[list, list, dict[str, int]]:
    """A delta file as vLLM's ``CheckpointWeightPatch`` lists (dense, sparse), its prints."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import CheckpointWeightPatch as P
    with CheckpointReader(path) as reader:
        delta = read_delta(path, dict(reader.metadata), {n: t.clone() for n, t in reader.tensors()})
    dense = [P(n, tuple(t.shape), t.dtype, t.reshape(-1)) for n, t in delta.dense]
    sparse = [P(n, s.shape, s.values.dtype, s.values, s.indices) for n, s in delta.sparse.items()]
    return dense, sparse, dict(delta.fingerprints)

class BenchWorkerExtension:
    """The benchmark's worker methods (``self`` is vLLM's worker)."""

    model_runner: Any  # vLLM's worker's
    vllm_config: Any  # vLLM's worker's
    _bench_src: dict | None = None  # the limits' tensors (bench_prepare_limits), and targets
    _bench_dst: dict | None = None
    _bench_undo: Any = None  # the pre-images of vLLM's patches (bench_vllm_snapshot)

    def bench_pid(self) -> int:
        return os.getpid()

    def bench_reload_mode(self) -> dict:
        """vLLM's ``VLLM_RELOAD_MODE`` here, and whether vLLM recorded the checkpoint layout."""
        import vllm.envs as envs
        recorded = hasattr(self.model_runner.get_model(), "_ckpt_param_names")
        return {"VLLM_RELOAD_MODE": getattr(envs, "VLLM_RELOAD_MODE", None),
                "layout_recorded": recorded}

    def bench_allocator(self, state: str) -> str:
        """The allocator: ``"kept"`` (a bridged CPU engine's) or glibc's defaults; its state."""
        from weight_bridge.vllm.worker import allocator
        kept = state == "kept"
        return allocator.keep_freed_memory() if kept else allocator.default_glibc_allocator()

    def bench_plan_cache(self, forget: bool = False) -> int | None:
        """``id`` of the plan cached on the model (None: none); ``forget`` drops it first."""
        state = bridge_state(self.model_runner.get_model())
        if forget:
            state.plan_cache = None
        return None if state.plan_cache is None else id(state.plan_cache[1])

    def bench_audit_s(self, reps: int = 21) -> float:
        """Median seconds of one address audit of the whole model (a push takes three)."""
        model = self.model_runner.get_model()
        return statistics.median(timed(lambda: addresses(model)) for _ in range(reps))

    def bench_overlap(self, overlapped: bool) -> float:
        """Each packed linear written and re-packed: in turn, or the re-pack in a second thread."""
        model = self.model_runner.get_model()
        modules = dict(model.named_modules())
        linears = [(modules[name], r) for name, r in bridge_state(model).refreshers.items()
                   if r.kind == "cpu packed linear"]
        sources = [module.weight.detach().clone() for module, _ in linears]
        with ThreadPoolExecutor(1) as pool:
            t0, pending = time.perf_counter(), None
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
        """FAULT INJECTION: the next call of the last down_proj loader raises (mid-push)."""
        params = dict(self.model_runner.get_model().named_parameters())
        name = [n for n in params if n.endswith("mlp.down_proj.weight")][-1]
        param, original = params[name], params[name].weight_loader
        def faulty(*args: Any, **kwargs: Any) -> None:
            param.weight_loader = original
            raise RuntimeError(f"benchmark fault in the weight loader of {name}")
        param.weight_loader = faulty

    def bench_prepare_limits(self, path: str) -> int:
        self._bench_src = tensors_of(path)
        self._bench_dst = {n: torch.zeros_like(t) for n, t in self._bench_src.items()}
        return sum(t.nbytes for t in self._bench_src.values())

    def bench_free_limits(self) -> None:
        self._bench_src = self._bench_dst = None
        gc.collect()

    def bench_copy(self) -> float:
        src, dst = self._bench_src or {}, self._bench_dst or {}
        return timed(lambda: [dst[name].copy_(t) for name, t in src.items()])

    def bench_read_copy(self, path: str) -> float:
        dst = self._bench_dst or {}
        def read_copy() -> None:
            with CheckpointReader(path) as reader:
                for name, t in reader.tensors():
                    dst[name].copy_(t)
        return timed(read_copy)

    def bench_layerwise_iter(self, path: str) -> float:
        t0 = time.perf_counter()
        with CheckpointReader(path) as reader:
            self.reload_weights(weights_iterator=reader.tensors(), is_checkpoint_format=True)  # type: ignore[attr-defined]
        return time.perf_counter() - t0

    def bench_layerwise_file(self, model_dir: str) -> float:
        """vLLM's layerwise reload from a directory (``model_config.model`` restored after)."""
        configs = {id(self.vllm_config.model_config): self.vllm_config.model_config}
        if (runner := getattr(self.model_runner, "vllm_config", None)) is not None:
            configs[id(runner.model_config)] = runner.model_config
        saved = {k: (c.model, c.model_weights, c.revision) for k, c in configs.items()}
        t0 = time.perf_counter()
        try:
            self.reload_weights(weights_path=model_dir, is_checkpoint_format=True)  # type: ignore[attr-defined]
        finally:
            for k, c in configs.items():
                c.model, c.model_weights, c.revision = saved[k]
        return time.perf_counter() - t0

    def bench_naive_loop(self, path: str) -> float:
        """What RL libraries commonly do: ``model.load_weights([(name, tensor)])`` per tensor."""
        model = self.model_runner.get_model()

        def naive() -> None:
            with CheckpointReader(path) as reader:
                for name, t in reader.tensors():
                    model.load_weights([(name, t)])
        return timed(naive)

    # vLLM's sparse patches (what ``sparse_nccl`` calls on each worker) on a bridged engine's
    # live model: snapshot, patch (timed), check, restore.

    def bench_vllm_snapshot(self) -> int:
        model = self.model_runner.get_model()
        self._bench_undo = UndoLog.pre_images(model, [p.detach() for p in model.parameters()], {})
        return self._bench_undo.nbytes

    def bench_vllm_patch(self, path: str) -> dict[str, Any]:
        """The delta by vLLM's patches, then the re-pack of what the bridge would refresh."""
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (
            load_checkpoint_weight_patches,
        )
        model, t0 = self.model_runner.get_model(), time.perf_counter()
        dense, sparse, _ = _patches(path)
        t1 = time.perf_counter()
        for group in (g for g in (dense, sparse) if g):
            load_checkpoint_weight_patches(model, group)
        t2 = time.perf_counter()
        self._bench_undo.modules = modules_to_refresh(model, [p.name for p in dense + sparse])
        refresh_derived_state(model, self._bench_undo.modules)
        return {"decode_s": t1 - t0, "apply_s": t2 - t1, "refresh_s": time.perf_counter() - t2,
                "tensors": len(dense) + len(sparse), "dense": len(dense),
                "changed": sum(p.values.numel() for p in dense + sparse)}

    def bench_vllm_check(self, path: str) -> dict[str, Any]:
        """Each touched tensor's exact fingerprint against the trainer's; writes elsewhere."""
        model, (dense, sparse, wanted) = self.model_runner.get_model(), _patches(path)
        write_map = bridge_state(model).write_map
        assert write_map is not None and self._bench_undo is not None, "snapshot first"
        held, wrong = {}, {}
        for patch in dense + sparse:
            got = exact_fingerprint(held_tensor(write_map, patch.name, patch.shape))
            held[patch.name] = format_fingerprint(got)
            if got != wanted[patch.name]:
                wrong[patch.name] = f"{got:016x}, the trainer's {wanted[patch.name]:016x}"
        touched = {p for n in held for p in write_map.params.get(n, set())}
        before = {_view(view): pre for view, _, pre in self._bench_undo.entries}
        elsewhere = [n for n, p in model.named_parameters()
                     if n not in touched and not _same(p, before[_view(p.detach())])]
        return {"fingerprints": held, "differs_from_trainer": wrong, "written_outside_the_delta":
                elsewhere, "equals_trainer": not wrong and not elsewhere}

    def bench_vllm_restore(self) -> bool:
        """The undo log put back; whether every parameter holds its pre-image again."""
        undo, self._bench_undo = self._bench_undo, None
        undo.undo(self.model_runner.get_model())
        return all(_same(view, pre) for view, _, pre in undo.entries)
# fmt: on
