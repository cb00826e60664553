"""Scale-out on this machine: vLLM tensor parallelism (TP=2 on two CPU cores) and Lightning
DDP with one colocated engine per rank."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
from helpers import TESTS, assert_differs, assert_parity, run_engine_check

TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.mark.slow
def test_tensor_parallel_push_matches_tensor_parallel_cold_start(models) -> None:
    """Each rank records its own layout, reads the file itself and keeps only its shard
    (tied Qwen2: the embedding and lm_head are vocabulary-sharded across the ranks)."""
    a, b = models["qwen2_A"], models["qwen2_B"]
    r = run_engine_check("push", str(a), str(b), "--tp", "2", env=TP2_ENV)
    assert r["workers"] == 2
    assert r["reports"][0]["workers"] == 2
    assert_parity(r["b_pushed"], r["b_cold"])
    assert_parity(r["a_pushed"], r["a_before"])
    assert_differs(r["b_pushed"], r["a_before"])
    assert r["addresses_unchanged"]


@pytest.mark.slow
def test_weight_mismatches_names_the_tensor_parallel_rank_that_holds_other_bits(models) -> None:
    """Issue 56.4: a replicated tensor (``model.norm.weight``, held whole by both ranks of a
    TP=2 multi-process engine) flipped in rank 0's live storage only (FAULT INJECTION: one bit,
    which nothing healthy causes) is named by ``weight_mismatches``, with rank 0 and its
    fingerprint, while rank 1 still holds the trainer's bits; before the flip it is not (the
    tensors split between the ranks are named as held whole by no worker, before and after)."""
    from weight_bridge.vllm.clients.checks import expected_fingerprints

    a, name = models["qwen2_A"], "model.norm.weight"
    env = {**TP2_ENV, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # the fault's callable only
    r = run_engine_check("mismatches", str(a), "--tp", "2", "--drift", name, env=env)
    assert r["workers"] == 2 and r["held"] == [True, True]  # replicated: whole on each rank
    sharded = "no worker holds it whole (sharded, or not in the engine's layout)"
    assert name not in r["before"] and set(r["before"].values()) == {sharded}, r["before"]
    assert r["drifted"][0] is not None and r["drifted"][1] is None
    assert name in r["after"], "rank 0's flipped copy reads as the trainer's (rank 1's hid it)"
    assert r["after"] == {**r["before"], name: r["after"][name]}, r["after"]
    (want,) = expected_fingerprints({name: _tensor(a, name)}).values()
    assert r["after"][name].startswith("rank 0 holds fingerprint "), r["after"]
    assert r["after"][name].endswith(f", the trainer's tensor is {want}"), r["after"]
    assert "rank 1" not in r["after"][name]


def _tensor(model, name: str):
    from weight_bridge.checkpoint import CheckpointReader

    with CheckpointReader(model / "model.safetensors") as reader:
        return dict(reader.tensors())[name].clone()


# Seconds from the kill to the end of the whole job, as the README states. Measured 28.7, 11.2
# and 25.4 s in three runs here (2 cores shared with other jobs; start-up took 142-235 s more).
DDP_FAILURE_BOUND_S = 120


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ddp_failure_on_one_rank_does_not_hang_the_other(models, tmp_path) -> None:
    """Rank 1's engine core is SIGKILLed at train start (after the first push): every rank
    raises and the whole job ends within DDP_FAILURE_BOUND_S seconds of the kill (start-up,
    before the kill, is not counted)."""
    script = TESTS / "ddp_sync_check.py"
    args = [str(models["llama_A"]), str(tmp_path / "sync"), "--fail-rank", "1"]
    stdout: list[tuple[float, str]] = []
    with open(tmp_path / "stderr.txt", "w+") as stderr:
        started = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, str(script), *args],
            env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"},  # each engine core apart
            stdout=subprocess.PIPE,
            stderr=stderr,  # a file: a full pipe can never stall the job
            text=True,
        )

        def read() -> None:  # each line with the time it arrived (the script flushes)
            assert proc.stdout is not None
            for line in proc.stdout:
                stdout.append((time.monotonic(), line))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            returncode = proc.wait(timeout=800)  # a hang fails the test instead of the run
        finally:
            proc.kill()
        ended = time.monotonic()
        reader.join(timeout=30)
        stderr.seek(0)
        err = stderr.read()
    killed = [t for t, line in stdout if "killed engine core" in line]
    assert killed, "rank 1 never killed its engine core:\n" + err[-3000:]
    took = ended - killed[0]
    print(f"\nstart-up {killed[0] - started:.1f} s, kill -> job ended {took:.1f} s")
    # The job ends with the dead engine named; rank 0 either raises "failed on another rank"
    # or is ended by Lightning's launcher first, depending on which notices first.
    assert returncode != 0
    assert "engine core process died" in err, err[-3000:]
    assert took < DDP_FAILURE_BOUND_S, f"the job took {took:.1f} s to end after the kill"


@pytest.mark.slow
def test_two_simulated_nodes_each_write_and_read_a_node_local_copy(models, cold, tmp_path):
    """Multi-node layout: node-local rank zero writes <dir>/node<k>; ranks read their node's.
    With ``delta="on"`` the syncs after the keyframe are deltas, each node writing its own copy
    of every one; each engine ends on the trained weights."""
    import socket

    from weight_bridge.checkpoint import CheckpointReader

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    weights = tmp_path / "trained.safetensors"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(TESTS / "ddp_sync_check.py"),
                str(models["llama_A"]),
                str(tmp_path / "sync"),
                "--nodes",
                "2",
                "--weights",
                str(weights),
            ],
            env={
                **os.environ,
                "PYTHONPATH": str(TESTS.parent),  # this checkout's code, whatever is installed
                "NODE_RANK": str(k),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k in (0, 1)
    ]
    outs = [p.communicate(timeout=900) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][1][-3000:] + outs[1][1][-3000:]
    results = [
        json.loads(ln[7:]) for o, _ in outs for ln in o.splitlines() if ln.startswith("RESULT")
    ]
    served = {r["rank"]: r["checkpoint"] for r in results}
    nodes = [tmp_path / "sync" / f"node{k}" for k in (0, 1)]
    assert served == {k: str(nodes[k] / "step-00000004.safetensors") for k in (0, 1)}
    with CheckpointReader(served[0]) as reader:
        assert reader.is_delta  # only what changed since step 2
    names = sorted(p.name for p in nodes[0].glob("step-*"))
    assert names == sorted(p.name for p in nodes[1].glob("step-*")) and len(names) == 3
    for name in names:  # every sync: the same file on each node
        assert (nodes[0] / name).read_bytes() == (nodes[1] / name).read_bytes(), name
    model_dir = tmp_path / "last"
    shutil.copytree(models["llama_A"], model_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    shutil.copy(weights, model_dir / "model.safetensors")
    for r in results:
        assert_parity(r["greedy"], cold(model_dir))
