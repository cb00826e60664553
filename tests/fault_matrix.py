"""The fault matrix of an update, in its own process: every fault point the code has
(:func:`faults.fault_points` (``tests/faults.py``): each phase of the transaction on entry and
on return, each writer of the registry as it starts, the loader mid-write, the refresh) times
every kind of exception (:data:`faults.KINDS`) times the pushes named,
on one engine (FAULT INJECTION through the fault plugin: nothing healthy raises there)::

    python tests/fault_matrix.py MODEL_A MODEL_B TMPDIR [--tp 2] [--rank R] [--pushes a,b]

Each case pushes onto weights A (label "A") and records, within a deadline (a hang fails
the case): the error, whether the fault fired, the label the next generated token carries,
each worker's digest of its parameters, and whether the engine is undefined; then repairs
the engine with a complete push of A if it is not on A. The result is judged by the test
(``tests/test_fault_matrix.py``): every case either refused or rolled back (label A, A's
bits on every rank), or succeeded (the push's label, its bits on every rank), or undefined
with the cause; never a label apart from its bits.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import time
from pathlib import Path

DEADLINE_S = 120.0  # a push that has not ended by then hangs


def _pushes(a: Path, b: Path, tmp: Path, wanted: list[str]) -> dict:
    """Each push of the matrix: (its file, its version, the session's reload mode, what the
    engine serves before it), its files built here."""
    import torch
    from helpers import (
        delta_checkpoint,
        keyframe_checkpoint,
        mixed,
        partial_checkpoint,
        save_checkpoint,
        tensors_of,
    )

    from weight_bridge.checkpoint import BASE_VERSION_KEY
    from weight_bridge.delta.format import FINGERPRINTS_KEY

    ta, tb = tensors_of(a), tensors_of(b)
    keyframe = keyframe_checkpoint(ta, "A", tmp / "keyframe-A.safetensors")
    full_b = keyframe_checkpoint(tb, "B", tmp / "full-B.safetensors")
    names = sorted(n for n in ta if n.endswith("mlp.down_proj.weight"))
    partial = partial_checkpoint(b, names, "A", "P", tmp / "partial-P.safetensors")
    target = mixed(ta, tb, 0.05, seed=0)
    target = {n: t.to(torch.float32) for n, t in target.items()}
    delta = delta_checkpoint(ta, target, "A", "D", tmp / "delta-D.safetensors")
    # another tool's 16-character digest under the bridge's key: parsed after the write, once
    malformed = {"version": "M", FINGERPRINTS_KEY: json.dumps({names[0]: "not-hex-digest!!"})}
    save_checkpoint(tb, tmp / "malformed-M.safetensors", malformed)
    bad_partial = {**malformed, BASE_VERSION_KEY: "A"}
    save_checkpoint({n: tb[n] for n in names}, tmp / "malformed-partial.safetensors", bad_partial)
    every = {
        "direct": (full_b, "B", "direct"),
        "partial": (partial, "P", "direct"),
        "delta": (delta, "D", "direct"),
        "layerwise": (full_b, "B", "layerwise"),
        "vllm-direct": (full_b, "B", "vllm-direct"),
    }
    return {"keyframe": keyframe, **{k: v for k, v in every.items() if k in wanted}}


def after_failure(point: str) -> bool:
    """A point only a failed update reaches (its rollback, or the failure recorded after the
    write): armed behind a first fault, the prefix-cache reset after every rank wrote."""
    return point.startswith(("fail:", "roll_back:"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_a")
    parser.add_argument("model_b")
    parser.add_argument("tmp")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--rank", type=int, default=None)
    parser.add_argument("--pushes", default="direct,partial,delta,layerwise")
    parser.add_argument("--points", default="")
    args = parser.parse_args()
    tmp = Path(args.tmp)
    fault_file = str(tmp / "fault.json")
    os.environ["WEIGHT_BRIDGE_TEST_FAULT_FILE"] = fault_file
    from faults import FAULTS, KINDS, arm_file, fault_points, install
    from helpers import ENGINE_KWARGS, weights_digest

    install(fault_file)  # this process (an in-process engine); the plugin: every other
    from weight_bridge import ColocatedEngine, EngineUndefinedError

    points = args.points.split(",") if args.points else fault_points()
    pushes = _pushes(Path(args.model_a), Path(args.model_b), tmp, args.pushes.split(","))
    keyframe = pushes.pop("keyframe")
    kwargs = {**ENGINE_KWARGS, "plugins": (*ENGINE_KWARGS["plugins"], FAULTS)}
    out: dict = {"states": {}, "cases": [], "points": points, "kinds": list(KINDS)}
    pool = concurrent.futures.ThreadPoolExecutor(1)
    with ColocatedEngine(args.model_a, tensor_parallel_size=args.tp, **kwargs) as engine:

        def state() -> dict:
            undefined = [u for u in engine._rpc("undefined") if u]
            try:
                label = engine.generate([[1, 20]], {"max_tokens": 1})[0].policy_version
            except EngineUndefinedError:
                label = None  # nothing is generated: no label to carry
            digest = engine.llm.collective_rpc(weights_digest)
            return {"label": label, "digest": digest, "undefined": (undefined or [None])[0]}

        def session(mode: str) -> None:
            engine.llm.init_weight_transfer_engine({"init_info": {"reload_mode": mode}})

        def on_a() -> None:
            session("direct")
            engine.push(keyframe, version="A")

        on_a()
        out["states"]["A"] = state()
        for bad in ("malformed-M", "malformed-partial"):
            try:
                engine.push(tmp / f"{bad}.safetensors", version="M")
                out[bad] = {"error": None}
            except Exception as exc:
                out[bad] = {"error": type(exc).__name__, "message": str(exc)}
                out[bad]["problems"] = dict(getattr(exc, "problems", {}) or {})
            out[bad].update(state())
        for name, (path, version, mode) in pushes.items():
            session(mode)
            try:
                engine.push(path, version=version)
                out["states"][name] = state()
            except Exception as exc:  # refused everywhere (vllm-direct on 0.32): still a case
                out["states"][name] = {"refused": f"{type(exc).__name__}: {exc}"}
            on_a()
        for name, (path, version, mode) in pushes.items():
            for point in points:
                for kind in KINDS:
                    session(mode)
                    first = [("prefix_reset", "refusal", args.rank)] if after_failure(point) else []
                    arm_file(fault_file, *first, (point, kind, args.rank))
                    case = {"push": name, "point": point, "kind": kind, "version": version}
                    started = time.monotonic()
                    future = pool.submit(engine.push, path, version=version)
                    try:
                        future.result(timeout=DEADLINE_S)
                        case["error"] = None
                    except concurrent.futures.TimeoutError:
                        case["hung"] = True
                        print("RESULT " + json.dumps({**out, "hung": case}), flush=True)
                        os._exit(3)
                    except Exception as exc:
                        case["error"] = f"{type(exc).__name__}: {exc}"
                    case["s"] = round(time.monotonic() - started, 3)
                    case["fired"] = not os.path.exists(fault_file)
                    if os.path.exists(fault_file):
                        os.unlink(fault_file)
                    case.update(state())
                    out["cases"].append(case)
                    if case["label"] != "A" or case["undefined"] is not None:
                        on_a()
                    elif case["digest"] != out["states"]["A"]["digest"]:
                        on_a()  # judged by the test: bits apart from their label
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)  # the engine is closed; skip interpreter teardown of vLLM's threads


if __name__ == "__main__":
    main()
