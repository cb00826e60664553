"""Run one engine scenario in a fresh process and print its results as JSON.

vLLM caches its environment once an engine starts, so the multi-process engine (vLLM's
default) and tensor parallelism are tested from their own processes through this script:

    python tests/engine_check.py push MODEL_A MODEL_B [--tp 2] [--compile] [--no-cold]
    python tests/engine_check.py cold MODEL [MODEL ...] [--cpu-linear stock]
    python tests/engine_check.py stock MODEL [--prompts JSON] [--max-tokens N] [--ignore-eos]
    python tests/engine_check.py partial MODEL_A PARTIAL [--tp 2]
    python tests/engine_check.py pushes MODEL_A FILE [FILE ...] [--tp 2] [--drift NAME]
    python tests/engine_check.py mismatches MODEL_A --tp 2 --drift NAME

``push`` starts a bridged engine on A, pushes B then A, and separately cold-starts B, recording
greedy outputs, every worker's addresses and the push reports; ``cold`` only cold-starts (each
model in turn, one engine at a time, in this one process);
``partial`` pushes A's own checkpoint (version 0), then the partial checkpoint on top of it;
``stock`` cold-starts a plain ``vllm.LLM`` (no bridge at all) on ``--prompts``; ``pushes``
pushes each file in turn (version: its position), recording each report or typed error and the
greedy outputs after it; with ``--drift NAME`` the last file (a delta) is pushed with
``readback="full"`` after one element of rank 0's shard of ``NAME`` that the delta does not
change was flipped in live storage (FAULT INJECTION: silent drift, which nothing healthy
causes). ``mismatches`` pushes A's own checkpoint, then records
:func:`~weight_bridge.vllm.weight_mismatches` against A's tensors before and after one element
of rank 0's copy of ``NAME`` was flipped in live storage (the same FAULT INJECTION).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "scenario", choices=["cold", "push", "partial", "stock", "pushes", "mismatches"]
    )
    parser.add_argument("model_a")
    parser.add_argument("model_b", nargs="?")
    parser.add_argument("more", nargs="*", help="cold: more models, one after the other")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--cpu-linear", default="repack")
    parser.add_argument("--reload-mode", default="direct")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--no-cold", action="store_true", help="push: no cold start of B")
    parser.add_argument("--pushes", type=int, default=1, help="B/A push rounds")
    parser.add_argument("--prompts", help="stock: JSON list of token-id lists")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument(
        "--drift", help="pushes: drift this tensor before the last (a delta); mismatches: flip it"
    )
    args = parser.parse_args()

    from helpers import ENGINE_KWARGS, PROMPTS, for_model, greedy

    from weight_bridge import ColocatedEngine
    from weight_bridge.testing import parity

    kwargs = dict(ENGINE_KWARGS, tensor_parallel_size=args.tp, cpu_linear=args.cpu_linear)
    if args.compile:
        kwargs["enforce_eager"] = False
    result: dict = {"pid": os.getpid()}
    if args.scenario == "stock":
        from vllm import LLM

        stock = {k: v for k, v in ENGINE_KWARGS.items() if k != "plugins"}
        llm = LLM(args.model_a, tensor_parallel_size=args.tp, **stock)
        prompts = json.loads(args.prompts) if args.prompts else PROMPTS
        result["cold"] = parity.greedy(
            llm, prompts, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos
        )
        print("RESULT " + json.dumps(result, default=str))
        return
    if args.scenario == "cold":
        models = [args.model_a, *([args.model_b] if args.model_b else []), *args.more]
        result["colds"] = []
        for model in models:
            with ColocatedEngine(model, **for_model(model, kwargs)) as engine:
                result["colds"].append(greedy(engine))
        result["cold"] = result["colds"][0]
        print("RESULT " + json.dumps(result, default=str))
        return
    if args.scenario == "pushes":
        result["steps"] = []
        with ColocatedEngine(args.model_a, **kwargs) as engine:
            paths = [args.model_b, *args.more]
            for i, path in enumerate(paths):
                step: dict = {}
                if args.drift and i == len(paths) - 1:
                    engine.readback = "full"
                    changed = _changed_positions(path, args.drift)
                    drifted = engine.llm.collective_rpc(drift_unchanged, args=(args.drift, changed))
                    step["drifted"] = drifted
                try:
                    step["report"] = engine.push(path, version=i).__dict__
                except Exception as exc:
                    step["error"] = {"type": type(exc).__name__, "message": str(exc)}
                    step["problems"] = getattr(exc, "problems", None)
                step["version"] = engine.version
                step["greedy"] = greedy(engine)
                result["steps"].append(step)
        print("RESULT " + json.dumps(result, default=str))
        return
    if args.scenario == "mismatches":
        result.update(_mismatches(args.model_a, args.drift, kwargs))
        print("RESULT " + json.dumps(result, default=str))
        return
    if args.scenario == "partial":
        with ColocatedEngine(args.model_a, **kwargs) as engine:
            addresses = engine.addresses()
            engine.push(Path(args.model_a) / "model.safetensors", version=0)
            report = engine.push(args.model_b)
            result["report"] = report.__dict__
            result["pushed"] = greedy(engine)
            result["addresses_unchanged"] = engine.addresses() == addresses
        print("RESULT " + json.dumps(result, default=str))
        return
    with ColocatedEngine(args.model_a, reload_mode=args.reload_mode, **kwargs) as engine:
        result["startup_s"] = engine.startup_s
        result["a_before"] = greedy(engine)
        addresses = engine.addresses()
        result["workers"] = len(addresses)
        reports = []
        for i in range(args.pushes):
            reports.append(engine.push(args.model_b, version=2 * i + 1).__dict__)
            result["b_pushed"] = greedy(engine)
            reports.append(engine.push(args.model_a, version=2 * i + 2).__dict__)
            result["a_pushed"] = greedy(engine)
        result["addresses_unchanged"] = engine.addresses() == addresses
        result["reports"] = reports
    if not args.no_cold:
        with ColocatedEngine(args.model_b, **kwargs) as engine:
            result["b_cold"] = greedy(engine)
    print("RESULT " + json.dumps(result, default=str))


def _mismatches(model: str, name: str, kwargs: dict) -> dict:
    """``weight_mismatches`` on the engine holding A, before and after rank 0's copy of
    ``name`` drifted (the flipped position per rank)."""
    from weight_bridge import ColocatedEngine
    from weight_bridge.checkpoint import CheckpointReader
    from weight_bridge.vllm import weight_mismatches

    with CheckpointReader(Path(model) / "model.safetensors") as reader:
        tensors = {n: t.clone() for n, t in reader.tensors()}
    with ColocatedEngine(model, **kwargs) as engine:
        report = engine.push(model, version="A")
        out: dict = {"workers": report.workers, "before": weight_mismatches(engine, tensors)}
        out["drifted"] = engine.llm.collective_rpc(drift_unchanged, args=(name, []))
        out["after"] = weight_mismatches(engine, tensors)
        out["held"] = [name in worker for worker in engine.fingerprints()]
    return out


def _changed_positions(path: str, name: str) -> list[int]:
    """The checkpoint positions of ``name`` the delta at ``path`` writes."""
    from weight_bridge.checkpoint import CheckpointReader
    from weight_bridge.delta.format import read_delta

    with CheckpointReader(path) as reader:
        delta = read_delta(path, reader.metadata, dict(reader.tensors()))
        return delta.sparse[name].indices.tolist()


def drift_unchanged(worker, name: str, changed: list[int]) -> int | None:
    """FAULT INJECTION (sent with ``collective_rpc``): on rank 0 only, flip the lowest bit of
    the first live element of ``name`` whose checkpoint position is not in ``changed``; its
    position (None on the other ranks)."""
    import torch

    from weight_bridge.direct.state import bridge_state
    from weight_bridge.exact import bits_of
    from weight_bridge.vllm.internals.model import worker_model

    if worker.rank != 0:
        return None
    seg = bridge_state(worker_model(worker)).write_map.segments[name][0]
    skip = set(changed)
    for k in range(seg.src_offset, seg.src_offset + seg.extent):
        if k in skip:
            continue
        held, where = seg.positions(torch.tensor([k]))
        for _, _, at in where.chunks(seg.storage.device):
            bits_of(seg.storage)[at] ^= 1
            return k
    return None


if __name__ == "__main__":
    main()
