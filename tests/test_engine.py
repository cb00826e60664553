"""The bridge inside real vLLM engines: cold-start parity, addresses, versions, bad input."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from helpers import (
    ENGINE_KWARGS,
    assert_differs,
    assert_parity,
    close_engine,
    greedy,
    run_engine_check,
)

from weight_bridge import ColocatedEngine
from weight_bridge.checkpoint import CheckpointError
from weight_bridge.direct import DirectReloadError
from weight_bridge.testing.models import build_tiny_model


def test_two_cold_starts_give_the_same_tokens(models, capsys) -> None:
    close_engine()
    runs = []
    for _ in range(2):
        with ColocatedEngine(models["llama_A"], **ENGINE_KWARGS) as engine:
            runs.append(greedy(engine))
            startup = engine.startup_s
        with capsys.disabled():
            print(f"\ntiny llama engine start-up: {startup:.2f} s (eager, in-process)")
    assert runs[0] == runs[1]


@pytest.mark.every_vllm
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_push_matches_cold_start_and_keeps_addresses(arch, models, shared_engine, cold) -> None:
    a, b = models[f"{arch}_A"], models[f"{arch}_B"]
    engine = shared_engine(f"{arch}_A")
    engine.push(a, version=0)
    assert_parity(greedy(engine), cold(a))
    addresses = engine.addresses()

    report = engine.push(b / "model.safetensors", version=1)
    assert report.mode == "direct" and report.tensors > 0 and report.bytes > 0
    got_b = greedy(engine)
    assert_parity(got_b, cold(b))
    assert_differs(got_b, cold(a))  # the push changed what the engine computes
    assert engine.addresses() == addresses

    engine.push(a, version=2)
    assert_parity(greedy(engine), cold(a))
    assert engine.addresses() == addresses


def test_outputs_carry_the_policy_version(models, shared_engine) -> None:
    engine = shared_engine("llama_A")
    for version in (7, 8, "step-9"):
        engine.push(models["llama_B" if version == 8 else "llama_A"], version=version)
        outs = engine.generate([[1, 2, 3]] * 3, {"max_tokens": 2})
        assert [o.policy_version for o in outs] == [str(version)] * 3  # the engine's label
        assert [c.versions for o in outs for c in o.completions] == [[str(version)] * 2] * 3
        assert engine.version == version


@pytest.mark.every_vllm
def test_prefix_cache_is_reset_by_a_push(models, engine_factory) -> None:
    """KV cached before a push is never reused after it. Blocks of 32 tokens (CPU attention
    takes multiples of 32) and 75-token prompts: two full blocks of each prompt are cached by a
    run, and the next run of the same prompt reuses them (checked, so the test can fail); right
    after a push, it reuses none."""
    from weight_bridge.testing.parity import collect

    prompts = [[1, *range(20, 94)], [1, *range(200, 274)]]
    full_blocks = 2 * 32
    sp = {"max_tokens": 12, "temperature": 0.0, "logprobs": 3}

    def run() -> tuple[list, list[int]]:
        outs = engine.generate(prompts, sp)
        return collect(outs), [o.num_cached_tokens or 0 for o in outs]

    engine = engine_factory(models["llama_B"], enable_prefix_caching=True, block_size=32)
    want_b, _ = run()  # B, cold
    again, cached = run()
    assert all(c >= full_blocks for c in cached), f"nothing cached: {cached}"
    assert_parity(again, want_b)

    engine.push(models["llama_A"], version=0)
    got_a, cached = run()
    assert cached == [0, 0], f"KV computed with B's weights reused after the push to A: {cached}"
    assert_differs(got_a, want_b)
    again, cached = run()  # A's KV now cached for these prompts
    assert all(c >= full_blocks for c in cached), cached
    assert_parity(again, got_a)

    engine.push(models["llama_B"], version=1)
    got_b, cached = run()
    assert cached == [0, 0], f"KV computed with A's weights reused after the push to B: {cached}"
    assert_parity(got_b, want_b)


def _bad_checkpoints(models, tmp_path: Path) -> dict[str, tuple[Path, type, str]]:
    from safetensors.torch import load_file, save_file

    b = load_file(models["llama_B"] / "model.safetensors")
    out = {}
    missing = dict(b)
    missing.pop("model.layers.0.mlp.down_proj.weight")
    save_file(missing, tmp_path / "missing.safetensors")
    out["missing"] = (tmp_path / "missing.safetensors", DirectReloadError, "missing")
    shaped = dict(b)
    shaped["model.norm.weight"] = shaped["model.norm.weight"][:-1].clone()
    save_file(shaped, tmp_path / "shape.safetensors")
    out["shape"] = (tmp_path / "shape.safetensors", DirectReloadError, "shape")
    raw = (models["llama_B"] / "model.safetensors").read_bytes()
    (tmp_path / "truncated.safetensors").write_bytes(raw[: len(raw) // 2])
    out["truncated"] = (tmp_path / "truncated.safetensors", CheckpointError, "truncated")
    other = build_tiny_model(tmp_path / "other", arch="qwen2", seed=5)
    out["other model"] = (other, DirectReloadError, "unexpected tensor")
    return out


@pytest.mark.every_vllm
def test_bad_checkpoints_are_rejected_and_engine_keeps_serving(
    models, shared_engine, cold, tmp_path
):
    engine = shared_engine("llama_A")
    engine.push(models["llama_A"], version="A")
    addresses = engine.addresses()
    for label, (path, error, words) in _bad_checkpoints(models, tmp_path).items():
        with pytest.raises(error, match=words):
            engine.push(path, version=label)
        assert engine.version == "A" and engine.undefined is None, label
        assert_parity(greedy(engine), cold(models["llama_A"]))
    assert engine.addresses() == addresses


def test_auto_reprocesses_only_the_packed_cpu_linears(models, cold, engine_factory):
    """cpu_linear="stock" leaves vLLM's packed oneDNN linears (weights emptied): ``direct``
    refuses them, ``auto`` writes the rest directly and hands only them to vLLM's layerwise."""
    a, b = models["llama_A"], models["llama_B"]
    engine = engine_factory(a, reload_mode="auto", cpu_linear="stock")
    plan = engine.plan("direct")[0]
    assert any("emptied" in why for why in plan["problems"].values())
    auto = engine.plan()[0]
    assert not auto["problems"] and auto["reprocess"] and auto["targets"]
    assert auto["mode"] == "auto"
    layerwise = engine.plan("layerwise")[0]  # the push's own plan: vLLM's reload writes all
    assert layerwise["mode"] == "layerwise" and not layerwise["targets"], layerwise
    report = engine.push(b, version=1)
    assert report.mode == "auto" and "re-processed by vLLM" in report.reason
    assert set(report.reprocessed) == set(auto["reprocess"])
    assert report.direct == len(auto["targets"])
    assert_parity(greedy(engine), cold(b, cpu_linear="stock"))


def test_layerwise_refuses_tied_packed_embedding(models, cold, engine_factory) -> None:
    """vLLM's layerwise reload leaves the tied lm_head's packed copy stale on CPU: refuse."""
    a, b = models["qwen2_A"], models["qwen2_B"]
    engine = engine_factory(a, reload_mode="layerwise", cpu_linear="stock")
    plan = engine.plan()[0]  # the dry run names what the push refuses, and no direct target
    assert plan["mode"] == "layerwise" and not plan["targets"], plan
    assert any("tied" in why for why in plan["problems"].values()), plan
    with pytest.raises(DirectReloadError, match="tied"):
        engine.push(b, version=1)
    assert_parity(greedy(engine), cold(a, cpu_linear="stock"))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize(("mode", "cpu_linear"), [("layerwise", "repack"), ("direct", "torch")])
def test_other_modes_match_cold_start(arch, mode, cpu_linear, models, cold, engine_factory):
    a, b = models[f"{arch}_A"], models[f"{arch}_B"]
    engine = engine_factory(a, reload_mode=mode, cpu_linear=cpu_linear)
    before = engine.addresses()
    engine.push(b, version=1)
    assert_parity(greedy(engine), cold(b, cpu_linear=cpu_linear))
    assert engine.addresses() == before


@pytest.mark.every_vllm
@pytest.mark.slow
def test_multiprocess_engine_push_matches_cold_start(models, cold) -> None:
    """vLLM's default engine (workers in their own processes), on the tied architecture; the
    reference is the shared in-process cold start (the same worker code computes both)."""
    a, b = str(models["qwen2_A"]), str(models["qwen2_B"])
    r = run_engine_check("push", a, b, "--no-cold")
    assert_parity(r["b_pushed"], cold(models["qwen2_B"]))
    assert_parity(r["a_pushed"], r["a_before"])
    assert_differs(r["b_pushed"], r["a_before"])
    assert r["addresses_unchanged"]


@pytest.mark.slow
def test_compiled_engine_push_matches_cold_start(models) -> None:
    """torch.compile on (vLLM's CPU default): weights are graph inputs, not baked constants.
    In-process (the multi-process engine is the test above): compiling twice is the cost."""
    a, b = str(models["qwen2_A"]), str(models["qwen2_B"])
    r = run_engine_check("push", a, b, "--compile", multiprocess=False)
    assert_parity(r["b_pushed"], r["b_cold"])
    assert_parity(r["a_pushed"], r["a_before"])
    assert r["addresses_unchanged"]


def test_a_users_worker_extension_composes_with_the_bridge(models, engine_factory) -> None:
    """The bridge reaches its workers through its backend, not a worker extension: a user's own
    (any class) goes to vLLM untouched, its methods answer through ``collective_rpc``, on the
    same model the pushes write, and the bridge's own queries still answer."""
    from weight_bridge.vllm.options import BACKEND_RPC

    a, b = models["llama_A"], models["llama_B"]
    engine = engine_factory(a, worker_extension_cls="helpers.UserWorkerExtension")
    name = "model.embed_tokens.weight"
    [sum_a] = engine.llm.collective_rpc("user_weight_sum", args=(name,))
    report = engine.push(b, version=1)
    assert report.mode == "direct" and report.tensors > 0
    [sum_b] = engine.llm.collective_rpc("user_weight_sum", args=(name,))
    assert sum_b != sum_a  # the user's method sees the pushed weights
    assert engine.plan()[0]["targets"] and engine.undefined is None
    assert engine.llm.collective_rpc(BACKEND_RPC, args=("undefined",)) == [None]
    engine.push(a, version=2)
    assert engine.llm.collective_rpc("user_weight_sum", args=(name,)) == [sum_a]


MP_EXECUTOR = dict(distributed_executor_backend="mp")  # the engine core here, the worker apart


def test_a_push_uses_the_cpu_vllm_leaves_spare(models, shared_engine, cold) -> None:
    """vLLM binds its worker processes to their CPUs and keeps the others for its engine core;
    while a push runs, the worker's split jobs (re-pack, finiteness pass) use those too: on
    this 2-CPU machine, two threads. Generation stays equal to a cold start."""
    engine = shared_engine("llama_A", **MP_EXECUTOR)
    report = engine.push(models["llama_B"], version="spare-B")
    assert_parity(greedy(engine), cold(models["llama_B"]))
    engine.push(models["llama_A"], version="spare-A")
    if len(os.sched_getaffinity(0)) == 2:
        assert report.threads == 2
    assert report.threads >= 1


def test_the_engine_core_sleeps_while_its_workers_push(models, shared_engine) -> None:
    """The engine core runs in this process: without the bridge it spins on its reply queue
    while the workers write (as much CPU time as wall time); with it, it sleeps."""
    from weight_bridge.vllm.internals.engine_core import waiting_without_spinning

    engine = shared_engine("llama_A", **MP_EXECUTOR)
    core = engine.llm.llm_engine.engine_core.engine_core
    queues = core.model_executor.response_mqs
    before = [mq._spin_condition.busy_loop_s for mq in queues]
    with waiting_without_spinning(core) as changed:
        assert changed == len(queues) >= 1
        assert all(mq._spin_condition.busy_loop_s == 0 for mq in queues)
    assert [mq._spin_condition.busy_loop_s for mq in queues] == before

    engine.push(models["llama_B"], version="sleep-0")
    # this thread's CPU time: the in-process engine core waits on the calling thread (the
    # process's would count whatever threads earlier tests left in it)
    cpu, wall = time.thread_time(), time.perf_counter()
    for i in range(6):
        engine.push(models["llama_A" if i % 2 else "llama_B"], version=f"sleep-{i + 1}")
    share = (time.thread_time() - cpu) / (time.perf_counter() - wall)
    # measured: 0.18 with the bridge's sleep, 0.63 with vLLM's spin (the update's
    # share of a tiny model's push)
    print(f"engine core thread CPU / wall over 6 pushes: {share:.2f}")
    assert share < 0.4, f"this thread's CPU time / wall time over 6 pushes: {share:.2f}"


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_idle_worker_leaves_its_cpu_to_the_trainer(models, shared_engine) -> None:
    """vLLM's worker spins for a second after each message it reads (a step, a call); a
    bridged CPU worker waits asleep, so the trainer has the CPU back right after a push."""
    engine = shared_engine("llama_A", **MP_EXECUTOR)
    worker = engine.llm.llm_engine.engine_core.engine_core.model_executor.workers[0].proc.pid
    engine.push(models["llama_B"], version="idle-B")
    engine.push(models["llama_A"], version="idle-A")
    before, wall = _cpu_seconds(worker), time.perf_counter()
    time.sleep(1.0)
    used = (_cpu_seconds(worker) - before) / (time.perf_counter() - wall)
    # vLLM's own wait: about 1.0 (one CPU for the whole second); asleep: ticks of nothing
    assert used < 0.3, f"the idle worker used {used:.2f} CPU-seconds per second after a push"


@pytest.mark.parametrize("busy_loop_s", [0.0, 0.01])
def test_a_shortened_wait_rechecks_its_queue_soon(tmp_path, monkeypatch, busy_loop_s) -> None:
    """vLLM's notification socket may drop a wake-up sent soon after another, and vLLM's own
    sleeper re-checks only every 5 s: a reader the bridge makes sleep sooner (the worker, the
    engine core during a push) re-checks every RECHECK_MS instead. A real vLLM queue wait, no
    writer: each wait returns after its timeout."""
    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    from weight_bridge.vllm.worker import cpu_threads
    from weight_bridge.vllm.worker.cpu_threads import RECHECK_MS, idle_wait

    # this process is not a bridged worker (an in-process engine earlier in the session made
    # it one): its own waits are shortened only where a caller shortened them
    monkeypatch.setattr(cpu_threads, "_sleeping", False)
    context = zmq.Context()
    reader = SpinCondition(True, context, f"ipc://{tmp_path}/notify")
    try:
        wait = idle_wait(SpinCondition.wait)
        reader.last_read = time.monotonic() - 1.0  # idle for a second
        reader.busy_loop_s = busy_loop_s
        started = time.perf_counter()
        wait(reader, 5000)  # what vLLM's queue passes an idle reader
        assert time.perf_counter() - started < 0.5  # RECHECK_MS, not 5 s
        reader.busy_loop_s = 1.0  # vLLM's own: left as it is
        reader.last_read = time.monotonic() - 2.0
        started = time.perf_counter()
        wait(reader, 200)
        assert time.perf_counter() - started >= 0.2 > RECHECK_MS / 1000
    finally:
        reader.local_notify_socket.close(linger=0)
        reader.read_cancel_socket.close(linger=0)
        reader.write_cancel_socket.close(linger=0)
        context.term()
