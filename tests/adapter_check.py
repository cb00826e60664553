"""Adapter versions through the multi-process entry points, in a fresh process.

    python tests/adapter_check.py ROOT BASE V1 V2 V3

A multi-process ``vllm.LLM`` (:class:`~weight_bridge.ColocatedEngine`), then an ``AsyncLLM``
(:class:`~weight_bridge.vllm.clients.async_colocated.AsyncColocatedEngine`), each started on BASE
with LoRA enabled (two slots): V1 and V2 pushed as adapters through the bridge's client, then
greedy outputs sampled by the client unnamed (the newest) and naming V1, with each token's label,
the engine's own label, and what naming a version never pushed raised; on the ``AsyncLLM`` also
V3 pushed while a long generation still computes with V1 (whose slot it would take), then again
once that generation ended. Prints ``RESULT {json}`` with one entry per engine. The engine
core, the workers and the front end run in separate processes here: the resident table crosses
as an engine-core utility, the labels are made in the front end.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # vLLM's default engine, even under pytest

LORA = dict(enable_lora=True, max_lora_rank=8, max_loras=2)
SAMPLING = dict(max_tokens=8, temperature=0.0, logprobs=1)


def _sampled(engine, version=None) -> list:
    out = engine.generate(PROMPTS, SAMPLING, version=version)
    return [
        (c.token_ids, c.logprobs, sorted({str(v) for v in c.versions}))
        for c in (g.completions[0] for g in out)
    ]


def _drive(engine, v1: str, v2: str) -> dict:
    from weight_bridge.vllm.errors import AdapterVersionError

    out: dict = {}
    for path, version in ((v1, "v1"), (v2, "v2")):
        out[f"mode_{version}"] = engine.push(path, version=version).mode
    out["newest"] = _sampled(engine)
    out["v1"] = _sampled(engine, "v1")
    try:
        engine.generate(PROMPTS, SAMPLING, version="v0")
    except AdapterVersionError as exc:
        out["gone"] = str(exc)
    return out


def _push_while_in_use(engine, v3: str) -> dict:
    """V3 pushed while a long generation on V1 runs, then after it ended."""
    from weight_bridge import DirectReloadError

    running = engine.submit(PROMPTS[:1], dict(max_tokens=120, ignore_eos=True), version="v1")
    out = {}
    try:
        engine.push(v3, version="v3")
    except DirectReloadError as exc:
        out["refused"] = str(exc)
    out["running_versions"] = sorted({str(v) for v in running.result()[0].completions[0].versions})
    out["after"] = engine.push(v3, version="v3").adapters
    out["newest_after"] = _sampled(engine)
    return out


def main() -> None:
    from helpers import ENGINE_KWARGS

    from weight_bridge import ColocatedEngine
    from weight_bridge.vllm.clients.async_colocated import AsyncColocatedEngine

    root, base, v1, v2, v3 = sys.argv[1:]
    kwargs = {**ENGINE_KWARGS, **LORA, "checkpoint_root": root}
    engines = []
    llm = ColocatedEngine(base, **kwargs)
    try:
        engines.append(_drive(llm, v1, v2) | {"label": llm.llm.get_weight_version()})
    finally:
        llm.close()
    engine = AsyncColocatedEngine(base, inflight=None, **kwargs)
    try:
        out = _drive(engine, v1, v2)
        out["label"] = engine.run(engine.engine.get_weight_version())
        engines.append(out | {"in_use": _push_while_in_use(engine, v3)})
    finally:
        engine.close()
    print("RESULT " + json.dumps({"engines": engines}), flush=True)


PROMPTS = ["hello world", "the quick brown fox", "a b c d"]

if __name__ == "__main__":
    main()
