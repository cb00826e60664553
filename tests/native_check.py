"""vLLM's own RL API on an engine started with the ``weight_bridge`` backend, in a fresh process.

    python tests/native_check.py llm ROOT MODEL_A MODEL_B [MODEL_A MODEL_B ...]
    python tests/native_check.py async ROOT MODEL_A MODEL_B [MODEL_A MODEL_B ...]
    python tests/native_check.py labels ROOT MODEL_A MODEL_B

``llm``: a multi-process ``vllm.LLM`` per pair; ``async``: an ``AsyncLLM`` per pair (always
multi-process). Each engine is started on A with ``weight_transfer_config={"backend":
"weight_bridge"}`` and ``additional_config={"weight_bridge": {"checkpoint_root": ROOT}}``, then
driven only through vLLM's calls (``start_weight_update``, ``update_weights``,
``finish_weight_update``, ``pause_generation``, ``resume_generation``). Prints ``RESULT {json}``
with, per engine: greedy outputs before and after pushing B, what a NaN checkpoint raised (type,
problems) and the outputs after it, and, for ``async``, long generations interrupted by a push
in ``recompute`` mode and by a refused push. ``labels``: an
:class:`~weight_bridge.vllm.clients.async_colocated.AsyncColocatedEngine` (``AsyncLLM``) generating
without a break while A and B are pushed alternately in each in-flight mode (every output with its
``weight_versions``), a push while another update is active, and one after a trainer died
holding the update (``update_timeout_s`` = :data:`UPDATE_TIMEOUT_S`).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # vLLM's default engine, even under pytest

LONG = 96
UPDATE_TIMEOUT_S = 3.0


def _engine_kwargs(root: str) -> dict:
    from helpers import ENGINE_KWARGS

    kwargs = {k: v for k, v in ENGINE_KWARGS.items() if k != "plugins"}
    kwargs["weight_transfer_config"] = {"backend": "weight_bridge"}
    kwargs["additional_config"] = {"weight_bridge": {"checkpoint_root": root}}
    return kwargs


def _nan_checkpoint(model_b: str, root: str) -> tuple[str, str]:
    import torch

    from weight_bridge.checkpoint import CheckpointReader, save_checkpoint

    with CheckpointReader(model_b) as reader:
        tensors = {n: t.clone() for n, t in reader.tensors()}
    name = sorted(tensors)[3]
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    path = Path(root) / f"nan-{Path(model_b).name}.safetensors"
    save_checkpoint(tensors, path)
    return str(path), name


def _refusal(exc: BaseException) -> dict:
    from weight_bridge.vllm.errors import UpdateInProgressError

    return {
        "type": type(exc).__name__,
        "problems": dict(getattr(exc, "problems", {})),
        "in_progress": isinstance(exc, UpdateInProgressError),
    }


def run_llm(root: str, model_a: str, model_b: str) -> dict:
    from helpers import greedy
    from vllm import LLM

    llm = LLM(model_a, **_engine_kwargs(root))
    out: dict = {"a": greedy(llm)}
    llm.start_weight_update()
    llm.update_weights({"update_info": {"checkpoint": model_b}})
    llm.finish_weight_update(weight_version="b")
    out["b"] = greedy(llm)
    out["version"] = llm.get_weight_version()
    nan, out["nan_tensor"] = _nan_checkpoint(model_b, root)
    llm.start_weight_update()
    try:
        llm.update_weights({"update_info": {"checkpoint": nan}})
    except Exception as exc:
        out["refusal"] = _refusal(exc)
    try:
        llm.finish_weight_update(weight_version="nan")
    except Exception as exc:
        out["finish_after_refusal"] = str(exc)
    out["after_refusal"] = greedy(llm)
    out["version_after_refusal"] = llm.get_weight_version()
    llm.start_weight_update()
    try:
        llm.start_weight_update()
    except Exception as exc:
        out["second_start"] = _refusal(exc) | {"message": str(exc)}
    llm.finish_weight_update()
    llm.llm_engine.engine_core.shutdown()
    return out


async def _stream(engine, i: int, ids: list[int], seen: dict, done: dict) -> None:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=LONG, temperature=0.0, ignore_eos=True)
    last = None
    async for output in engine.generate(
        {"prompt_token_ids": ids}, sp, request_id=f"r{i}-{id(seen)}"
    ):
        seen[i] = len(output.outputs[0].token_ids)
        last = output
    completion = last.outputs[0]
    spans = [(s.version, s.start, s.end) for s in completion.weight_versions or ()]
    done[i] = (list(completion.token_ids), spans)


async def _interrupted(engine, client, prompts, checkpoint, version) -> tuple[dict, object]:
    """Long generations, a push in flight once each has 4 tokens; outputs and the outcome."""
    seen = {i: 0 for i in range(len(prompts))}
    done: dict = {}
    tasks = [asyncio.create_task(_stream(engine, i, p, seen, done)) for i, p in enumerate(prompts)]
    while min(seen.values()) < 4:
        await asyncio.sleep(0.001)
    try:
        report = await client.push_async(checkpoint, version=version, inflight="recompute")
        outcome: object = {"paused_s": report.paused_s}
    except Exception as exc:
        outcome = _refusal(exc)
    await asyncio.gather(*tasks)
    return done, outcome


async def run_async(root: str, model_a: str, model_b: str) -> dict:
    from helpers import PROMPTS
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    from weight_bridge.testing.parity import collect
    from weight_bridge.vllm.clients.async_llm import AsyncLLMClient

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model_a, **_engine_kwargs(root)))
    client = AsyncLLMClient(engine, inflight=None)

    async def greedy() -> list:
        sp = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3)
        outs = []
        for i, ids in enumerate(PROMPTS):
            async for o in engine.generate({"prompt_token_ids": ids}, sp, request_id=f"g{i}"):
                last = o
            outs.append(last)
        return collect(outs)

    out: dict = {"a": await greedy()}
    await client.push_async(model_b, version="b")
    out["b"] = await greedy()
    nan, out["nan_tensor"] = _nan_checkpoint(model_b, root)
    try:
        await client.push_async(nan, version="nan")
    except Exception as exc:
        out["refusal"] = _refusal(exc)
    out["version_after_refusal"] = await engine.get_weight_version()
    prompts = [[1, 20, 21, 22], [1, 5, 9, 30, 31], [1, 100, 101]]
    out["prompts"] = prompts
    await client.push_async(model_a, version="old")
    out["recompute"], out["recompute_outcome"] = await _interrupted(
        engine, client, prompts, model_b, "new"
    )
    await client.push_async(model_a, version="kept")
    out["refused"], out["refused_outcome"] = await _interrupted(
        engine, client, prompts, nan, "never"
    )
    engine.shutdown()
    return out


def run_labels(root: str, model_a: str, model_b: str) -> dict:
    import time

    from helpers import ENGINE_KWARGS, LABEL_PROMPTS, LABEL_TOKENS, pushes_under_load

    from weight_bridge.vllm.clients.async_colocated import AsyncColocatedEngine

    kwargs = {k: v for k, v in ENGINE_KWARGS.items() if k != "plugins"}
    engine = AsyncColocatedEngine(
        model_a, inflight=None, checkpoint_root=root, update_timeout_s=UPDATE_TIMEOUT_S, **kwargs
    )
    sp = {"max_tokens": LABEL_TOKENS, "temperature": 0.0, "ignore_eos": True}

    def generate(ids: list[int]) -> tuple[list[int], list]:
        completion = engine.generate([ids], sp)[0].completions[0]
        spans = [(str(s.version), s.start, s.end) for s in completion.spans]
        return list(completion.token_ids), spans

    checkpoints = {"B": Path(model_b), "A": Path(model_a)}
    out: dict = {"modes": {}}
    engine.push(model_a, version="A")
    for mode in (None, "keep", "recompute", "drain"):

        def push(path: Path, version: str, mode=mode) -> None:
            engine.push(path, version=version, inflight=mode)

        out["modes"][str(mode)] = pushes_under_load(generate, push, checkpoints, pushes=12)
    raw = engine.engine
    engine.run(raw.start_weight_update())  # another trainer holds the update
    try:
        engine.push(model_b, version="B", inflight="recompute")
    except Exception as exc:
        out["second"] = _refusal(exc) | {"message": str(exc)}
    out["paused_after_refusal"] = engine.run(raw.is_paused())
    engine.run(raw.finish_weight_update())
    out["version_after_second"] = engine.run(raw.get_weight_version())
    engine.run(raw.start_weight_update())  # ... and dies holding it
    died = time.monotonic()
    waited: list[str] = []
    while True:
        try:
            engine.push(model_b, version="B")
            break
        except Exception as exc:
            waited.append(type(exc).__name__)
            if time.monotonic() - died > UPDATE_TIMEOUT_S + 10:
                raise
            time.sleep(0.2)
    out["dead"] = {"waited_s": time.monotonic() - died, "refusals": sorted(set(waited))}
    out["after_dead"] = [generate(ids)[0] for ids in LABEL_PROMPTS]
    out["version_after_dead"] = engine.run(raw.get_weight_version())
    engine.close()
    return out


def main() -> None:
    mode, root, *models = sys.argv[1:]
    if mode == "labels":
        result = run_labels(root, *models)
        print("RESULT " + json.dumps(result, default=str), flush=True)
        return
    engines = []
    for model_a, model_b in zip(models[::2], models[1::2], strict=True):
        if mode == "llm":
            engines.append(run_llm(root, model_a, model_b))
        else:
            engines.append(asyncio.run(run_async(root, model_a, model_b)))
    print("RESULT " + json.dumps({"engines": engines}, default=str), flush=True)


if __name__ == "__main__":
    main()
