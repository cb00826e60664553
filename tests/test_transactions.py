"""Transactional pushes and typed refusals, in vLLM's default multi-process engine first.

* Every bad-input case of the reliability suite, pushed into a multi-process engine: the
  project's own error type with the tensor (and file) named, nothing changed, and no traceback
  or ERROR line in the engine's log.
* Faults after writing started, in the write (a weight loader raises), in the refresh of
  derived state (a refresher raises) and in the prefix-cache reset: with rollback (the default)
  the engine serves the previous version again, equal to its cold start; with rollback off it
  is undefined until a complete push.
* An interrupt during a push propagates as ``KeyboardInterrupt``.

FAULT INJECTION: the faults are raised by wrapping a weight loader or a refresher (sent to the
workers with ``collective_rpc``), or the engine core's ``reset_prefix_cache``: none can be
caused from outside on a healthy machine. The engine core is reachable only when it runs in the
test's process, so the cache fault is injected in-process only (the code after it is the same
in both engines). Everything else is a real engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    ENGINE_KWARGS,
    FAULT_PARAM,
    arm_cache_fault,
    arm_write_fault,
    assert_differs,
    assert_parity,
    bad_checkpoints,
    greedy,
    run_script,
)

from weight_bridge.direct import DirectReloadError

# -- worker-side callables (sent with collective_rpc; arm_write_fault is in helpers) -----------


def weights_fingerprint(worker) -> dict[str, float]:
    """A checksum of each of the worker's parameters (observation only): which weights a push
    had written when a fault struck."""
    import torch

    with torch.no_grad():
        params = worker.model_runner.get_model().named_parameters()
        return {name: float(p.detach().double().sum()) for name, p in params}


def take_fingerprint_at_fault(worker) -> dict | None:
    """The fingerprint the last fault recorded as it struck (and forget it)."""
    return vars(worker).pop("_test_fingerprint_at_fault", None)


def _record_fingerprint(worker) -> None:
    worker._test_fingerprint_at_fault = weights_fingerprint(worker)


def arm_recorded_write_fault(worker) -> None:
    """``arm_write_fault``, recording the weights' fingerprint as the fault strikes."""
    arm_write_fault(worker)
    param = dict(worker.model_runner.get_model().named_parameters())[FAULT_PARAM]
    faulty = param.weight_loader

    def record_then_fail(*args, **kwargs):
        _record_fingerprint(worker)
        return faulty(*args, **kwargs)  # puts the original loader back, then raises

    param.weight_loader = record_then_fail


def arm_refresh_fault(worker) -> str:
    """FAULT INJECTION: the next refresh of one module's derived state raises."""
    from weight_bridge.direct.state import bridge_state

    refreshers = bridge_state(worker.model_runner.get_model()).refreshers
    name = sorted(refreshers)[-1]
    refresher = refreshers[name]
    original = refresher.refresh

    def faulty(module):
        refresher.refresh = original  # type: ignore[method-assign]
        _record_fingerprint(worker)
        raise RuntimeError(f"injected fault refreshing {name}")

    refresher.refresh = faulty  # type: ignore[method-assign]
    return name


def arm(engine, fault: str) -> None:
    if fault == "write":
        engine.llm.collective_rpc(arm_recorded_write_fault)
    elif fault == "refresh":
        engine.llm.collective_rpc(arm_refresh_fault)
    else:
        arm_cache_fault(engine, lambda core: core.collective_rpc(_record_fingerprint))


FAULTS = ("write", "refresh", "cache")


def fault_scenarios(model_a: str, model_b: str) -> dict:
    """One engine: a healthy round, each fault with rollback, each fault without."""
    from weight_bridge import ColocatedEngine, EngineUndefinedError
    from weight_bridge.vllm.internals.engine_client import engine_resources

    r: dict = {"rollback": {}, "no_rollback": {}}
    with ColocatedEngine(model_a, **ENGINE_KWARGS) as engine:
        in_process = engine_resources(engine.llm) is None
        faults = FAULTS if in_process else tuple(f for f in FAULTS if f != "cache")
        r["a_cold"] = greedy(engine)
        r["a_weights"] = engine.llm.collective_rpc(weights_fingerprint)[0]
        engine.push(model_b, version="B")
        r["b_pushed"] = greedy(engine)
        r["b_weights"] = engine.llm.collective_rpc(weights_fingerprint)[0]
        engine.push(model_a, version="A")
        for fault in faults:
            arm(engine, fault)
            case: dict = {}
            try:
                engine.push(model_b, version="B")
                case["error"] = None
            except Exception as exc:
                case["error"], case["message"] = type(exc).__name__, str(exc)
            case["version"], case["undefined"] = engine.version, engine.undefined
            case["rollback_s"] = engine.last_rollback_s
            case["served"] = greedy(engine)
            case["at_fault"] = engine.llm.collective_rpc(take_fingerprint_at_fault)[0]
            case["after"] = engine.llm.collective_rpc(weights_fingerprint)[0]
            r["rollback"][fault] = case
        engine.rollback = False
        for fault in faults:
            arm(engine, fault)
            case = {}
            try:
                engine.push(model_b, version="B")
                case["error"] = None
            except Exception as exc:
                case["error"], case["message"] = type(exc).__name__, str(exc)
            case["undefined"] = engine.undefined
            try:
                greedy(engine)
                case["generate"] = None
            except EngineUndefinedError as exc:
                case["generate"] = type(exc).__name__
            case["vllm_generate"] = vllm_generate_while_undefined(engine.llm)
            engine.push(model_b, version="B")
            case["recovered"] = greedy(engine)
            engine.push(model_a, version="A")
            r["no_rollback"][fault] = case
    return r


def vllm_generate_while_undefined(llm) -> dict:
    """vLLM's own ``LLM.generate`` on the engine (no bridge client in between): how long it
    took, and each output's finish reason and stop reason."""
    from vllm import SamplingParams

    started = time.monotonic()
    outputs = llm.generate(
        [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5]}],
        SamplingParams(max_tokens=4),
        use_tqdm=False,
    )
    return {
        "seconds": time.monotonic() - started,
        "ends": [(o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in outputs],
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
    }


def refusal_scenarios(model_a: str, cases_json: str) -> dict:
    from weight_bridge import ColocatedEngine

    cases = json.loads(Path(cases_json).read_text())
    out: dict = {}
    with ColocatedEngine(model_a, **ENGINE_KWARGS) as engine:
        engine.push(model_a, version="A")
        before = greedy(engine)
        addresses = engine.addresses()
        for label, path, kw in cases:
            try:
                engine.push(path, version=label, **kw)
                out[label] = {"type": None}
            except Exception as exc:
                problems = getattr(exc, "problems", None)
                out[label] = {"type": type(exc).__name__, "message": str(exc)}
                out[label]["problems"] = problems
            out[label]["unchanged"] = engine.version == "A" and engine.undefined is None
        out["_served_unchanged"] = greedy(engine) == before
        out["_addresses_unchanged"] = engine.addresses() == addresses
    return out


def _run(*args: str, multiprocess: bool = True) -> tuple[dict, str]:
    # Only so that the fault-injecting callables can be sent to the worker process: the
    # bridge itself calls its worker methods by name and needs no pickling.
    env = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    return run_script("test_transactions.py", *args, multiprocess=multiprocess, env=env)


@pytest.mark.slow
def test_refusals_are_typed_and_quiet_in_the_multiprocess_engine(models, tmp_path) -> None:
    cases = bad_checkpoints(models, tmp_path)
    spec = [(label, str(path), kw) for label, path, kw, *_ in cases]
    (tmp_path / "cases.json").write_text(json.dumps(spec))
    got, log = _run("refusals", str(models["llama_A"]), str(tmp_path / "cases.json"))
    for label, _, _, error, words, named_file, tensor in cases:
        r = got[label]
        assert r["type"] == error.__name__, (label, r)
        assert words in r["message"], (label, r["message"])
        assert str(named_file.resolve()) in r["message"] or str(named_file) in r["message"]
        if tensor is not None and error is DirectReloadError:
            assert tensor in r["problems"], (label, r)
        assert r["unchanged"], label
    assert got["_served_unchanged"] and got["_addresses_unchanged"]
    assert "Traceback" not in log
    assert not [ln for ln in log.splitlines() if " ERROR " in ln], log[-3000:]


def _check_faults(r: dict) -> None:
    a, b = r["a_weights"], r["b_weights"]
    assert_differs(r["b_pushed"], r["a_cold"])  # equal to A after a rollback means something
    for fault, case in r["rollback"].items():
        assert case["error"] == "DirectReloadError", (fault, case)
        assert "rolled back to version 'A'" in case["message"], (fault, case["message"])
        assert case["version"] == "A" and case["undefined"] is None, fault
        # the push had written B's weights when the fault struck: there was something to undo
        assert case["at_fault"] is not None, f"{fault}: the fault never struck"
        written = [n for n, v in case["at_fault"].items() if v != a[n] and v == b[n]]
        assert written, f"{fault}: no weight of B written before the fault"
        assert case["after"] == a, fault  # and all of it was undone
        assert_parity(case["served"], r["a_cold"])
        assert case["rollback_s"] is not None
    for fault, case in r["no_rollback"].items():
        assert case["error"] == "DirectReloadError", (fault, case)
        assert case["undefined"] and case["generate"] == "EngineUndefinedError", fault
        # vLLM's own LLM.generate ends every request with an error naming why, at once
        # (before the bridge's step: it spun at full CPU on a paused scheduler, forever)
        own = case["vllm_generate"]
        assert own["seconds"] < 10 and own["tokens"] == [[], []], (fault, own)
        for reason, why in own["ends"]:
            assert reason == "error" and "weights are undefined" in why, (fault, own)
            assert "injected fault" in why or "failed" in why, (fault, why)
        assert_parity(case["recovered"], r["b_pushed"])
    assert "injected fault in the weight loader" in r["rollback"]["write"]["message"]
    assert "injected fault refreshing" in r["rollback"]["refresh"]["message"]
    if "cache" in r["rollback"]:  # in-process only (see the module docstring)
        assert "prefix cache reset failed" in r["rollback"]["cache"]["message"]


@pytest.mark.every_vllm
@pytest.mark.slow
def test_faults_after_writing_roll_back_in_the_multiprocess_engine(models) -> None:
    r, _ = _run("faults", str(models["llama_A"]), str(models["llama_B"]))
    _check_faults(r)


@pytest.mark.every_vllm
def test_faults_after_writing_roll_back_in_process(models) -> None:
    r, _ = _run("faults", str(models["llama_A"]), str(models["llama_B"]), multiprocess=False)
    _check_faults(r)


def test_interrupt_during_a_push_propagates(models, shared_engine, cold) -> None:
    a, b = models["llama_A"], models["llama_B"]
    engine = shared_engine("llama_A")
    engine.push(a, version="A")
    engine.llm.collective_rpc(arm_write_fault, args=("interrupt",))
    with pytest.raises(KeyboardInterrupt):
        engine.push(b, version="B")
    assert engine.undefined and engine.version == "A"
    engine.push(a, version="A")
    assert engine.undefined is None
    assert_parity(greedy(engine), cold(a))


def arm_plan_fault(worker) -> None:
    """FAULT INJECTION (sent with ``collective_rpc``): the next push's plan raises
    ``MemoryError``, an allocation failing mid-prepare after the file was opened and held (not
    something a healthy machine can be made to do on cue). One shot."""
    transaction = worker.weight_transfer_engine.transaction
    original = transaction._job  # what the writer is prepared from, once the file is held

    def faulty(*args, **kwargs):
        transaction._job = original
        raise MemoryError("injected: an allocation failed mid-prepare")

    transaction._job = faulty


def held_by_worker(worker, path: str) -> dict[str, int]:
    """What this worker's process still holds of ``path``: open descriptors and mappings."""
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            fds += os.readlink(f"/proc/self/fd/{fd}") == path
    maps = sum(path in line for line in Path("/proc/self/maps").read_text().splitlines())
    return {"fds": fds, "maps": maps}


def test_an_untyped_error_mid_prepare_holds_nothing(models, shared_engine, tmp_path) -> None:
    """Any exception while a push is prepared (here ``MemoryError``) releases the file it
    opened: no descriptor, lock or map is left in the worker, so the file can be recycled and
    its memory returned; nothing was written and the next push lands."""
    import shutil

    a, b = models["llama_A"], models["llama_B"]
    engine = shared_engine("llama_A")
    engine.push(a, version="A")
    path = tmp_path / "step-B.safetensors"
    shutil.copy(b / "model.safetensors", path)
    engine.llm.collective_rpc(arm_plan_fault)
    with pytest.raises(Exception, match="injected: an allocation failed mid-prepare"):
        engine.push(path, version="B")
    assert engine.version == "A" and engine.undefined is None
    held = engine.llm.collective_rpc(held_by_worker, args=(str(path.resolve()),))
    assert held == [{"fds": 0, "maps": 0}] * len(held), held
    assert engine.push(path, version="B").version == "B"
    engine.push(a, version="A")


def test_an_update_without_a_start_is_refused_and_writes_nothing(models, shared_engine) -> None:
    """vLLM's contract (``start_weight_update`` before ``update_weights``), which its worker
    checked before the engine core sent the prepare itself: refused by type, nothing written,
    the next push lands."""
    a, b = models["llama_A"], models["llama_B"]
    engine = shared_engine("llama_A")
    engine.push(a, version="A")
    before = engine.llm.collective_rpc(weights_fingerprint)
    with pytest.raises(DirectReloadError, match="start_weight_update must be called before"):
        engine.llm.update_weights({"update_info": {"checkpoint": str(b), "version": "B"}})
    assert engine.llm.collective_rpc(weights_fingerprint) == before
    assert engine.push(b, version="B").version == "B"
    engine.push(a, version="A")


if __name__ == "__main__":
    if sys.argv[1] == "faults":
        result = fault_scenarios(sys.argv[2], sys.argv[3])
    else:
        result = refusal_scenarios(sys.argv[2], sys.argv[3])
    print("RESULT " + json.dumps(result, default=str), flush=True)


def test_rollback_reads_a_served_checkpoint_deleted_meanwhile(
    models, shared_engine, cold, tmp_path
) -> None:
    """The engine holds a descriptor on the file it serves: deleted by something else, its
    bytes still roll a failed push back."""
    import shutil

    a, b = models["llama_A"], models["llama_B"]
    served = tmp_path / "step-A.safetensors"
    shutil.copy(a / "model.safetensors", served)
    engine = shared_engine("llama_A")
    engine.push(served, version="A")
    served.unlink()
    engine.llm.collective_rpc(arm_write_fault)
    with pytest.raises(DirectReloadError, match="rolled back to version 'A'"):
        engine.push(b, version="B")
    assert engine.version == "A" and engine.undefined is None
    assert engine.checkpoint == str(served)
    assert_parity(greedy(engine), cold(a))
    engine.push(a, version="A")
