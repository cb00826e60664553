"""The engines a benchmark measures, and the calls every measurement makes on them.

* :func:`start_engine`: a :class:`~weight_bridge.vllm.ColocatedEngine` with the benchmark's
  worker extension, its engine arguments and the model's directory as checkpoint root;
* :func:`start_stock_engine`: vLLM's own ``LLM``, without the bridge (vLLM's own speed and its
  own reload, as a user of vLLM gets them);
* :func:`push`, :func:`api_reload`, :func:`rpc`, :func:`rpc_reload`: one timed update by
  each path;
* :func:`greedy`, :func:`generation_rate`: outputs for the correctness checks, tokens/s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from weight_bridge.testing import parity

from .config import ENGINE_KWARGS, GEN_BATCH, PARITY_PROMPTS, PARITY_TOKENS
from .worker import BENCH_EXTENSION

__all__ = [
    "StockEngine",
    "api_reload",
    "gen_call",
    "generation_rate",
    "greedy",
    "push",
    "rpc",
    "rpc_reload",
    "start_engine",
    "start_stock_engine",
]


def start_engine(model: Path, root: Path | None = None, **kwargs: Any) -> Any:
    """A bridged engine on ``model``; pushes may read under ``root`` (default: the directory
    holding the model's directory, where the benchmark keeps every checkpoint)."""
    from weight_bridge.vllm import ColocatedEngine

    return ColocatedEngine(
        model,
        checkpoint_root=root or Path(model).parent,
        worker_extension_cls=BENCH_EXTENSION,
        **{**ENGINE_KWARGS, **kwargs},
    )


class StockEngine:
    """vLLM's ``LLM`` as vLLM ships it (no ``weight_transfer_config``, so the plugin leaves
    it alone): the same engine arguments and worker extension as the bridged engines."""

    def __init__(self, model: Path, **kwargs: Any) -> None:
        from vllm import LLM

        started = time.perf_counter()
        args = {**ENGINE_KWARGS, **kwargs}
        self.llm = LLM(model=str(model), worker_extension_cls=BENCH_EXTENSION, **args)
        self.startup_s = time.perf_counter() - started

    def generate(self, prompts: Any, sampling_params: Any = None) -> list:
        """``vllm.LLM.generate``, read into the bridge's clients' result type."""
        from weight_bridge.vllm.generation import Generation

        outputs = self.llm.generate(prompts, sampling_params, use_tqdm=False)
        top = getattr(sampling_params, "logprobs", None)
        return [Generation.from_request_output(o, top) for o in outputs]

    def close(self) -> None:
        from weight_bridge.vllm.internals import shutdown

        llm, self.llm = self.llm, None
        if llm is not None:
            shutdown(llm)


def start_stock_engine(model: Path, **kwargs: Any) -> StockEngine:
    """vLLM's own engine on ``model``; ``kwargs`` override the benchmark's engine arguments."""
    return StockEngine(model, **kwargs)


def greedy(engine: Any, max_tokens: int = PARITY_TOKENS) -> list:
    """Greedy tokens and sorted top-3 logprobs per parity prompt."""
    return parity.greedy(engine, PARITY_PROMPTS, max_tokens, logprobs=3, ignore_eos=True)


def gen_call(engine: Any, tokens: int) -> Callable[[int], float]:
    return lambda rep: generation_rate(engine, tokens)


def generation_rate(engine: Any, tokens: int) -> float:
    """Tokens/s of one fixed greedy batch (``GEN_BATCH`` prompts, prefill included)."""
    from vllm import SamplingParams

    from weight_bridge.vllm import token_prompts

    prompts = token_prompts([[1, 10 + i, 20 + i, 30 + i, 40 + i] for i in range(GEN_BATCH)])
    sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, sp)
    dt = time.perf_counter() - t0
    return sum(len(g.completions[0].token_ids) for g in outs) / dt


def push(
    engine: Any,
    ckpt: Path,
    version: Any,
    check_finite: bool = True,
    verify: bool = False,
    readback: str = "sampled",
    mode: str = "direct",
) -> dict[str, float]:
    """One ``ColocatedEngine.push``; ``check_finite=False`` turns the NaN/Inf guard off,
    ``readback`` sets the read-back proof of the writes (the default is ``"sampled"``);
    ``mode``: the report's mode the push must have gone (the engine's ``reload_mode``)."""
    if readback != "sampled":
        engine.readback = readback
    try:
        report = engine.push(ckpt, version=version, verify_hash=verify, check_finite=check_finite)
    finally:
        if readback != "sampled":
            engine.readback = "sampled"
    if report.mode != mode:
        raise RuntimeError(f"push went {report.mode}: {report.reason}")
    return {
        "elapsed_s": report.elapsed_s,
        "read_s": report.preflight_s,
        "write_s": report.write_s,
        "refresh_s": report.refresh_s,
        "readback_s": report.readback_s,
        # what the worker did not spend validating, writing, reading back or refreshing: the
        # RPCs, the checkpoint's headers, the address audit, the prefix-cache reset
        "overhead_s": report.elapsed_s
        - report.preflight_s
        - report.write_s
        - report.readback_s
        - report.refresh_s,
    }


def rpc(engine: Any, method: str, *args: Any) -> float:
    """The slowest worker's answer of a benchmark worker method (a time in seconds)."""
    return max(engine.llm.collective_rpc(method, args=args))


def rpc_reload(engine: Any, method: str, arg: str) -> dict[str, float]:
    """A reload by another path, timed like a push: the whole call plus the prefix-cache reset
    (which ``push`` also pays and any weight change needs)."""
    t0 = time.perf_counter()
    inner = rpc(engine, method, arg)
    engine.llm.reset_prefix_cache()
    return {"elapsed_s": time.perf_counter() - t0, "inner_s": inner}


def api_reload(engine: Any, folder: str) -> dict[str, float]:
    """vLLM's own checkpoint-format reload through its public API, as RL libraries call it
    (``collective_rpc("reload_weights", kwargs={"weights_path": ...})``), plus the prefix-cache
    reset that a push also pays (vLLM's own reload leaves the cache as it was)."""
    kwargs = {"weights_path": folder, "is_checkpoint_format": True}
    t0 = time.perf_counter()
    engine.llm.collective_rpc("reload_weights", kwargs=kwargs)
    engine.llm.reset_prefix_cache()
    return {"elapsed_s": time.perf_counter() - t0}
