"""Whatever raises, one outcome: the fault matrix of an update (``tests/fault_matrix.py``:
every fault point the code has, from :func:`faults.fault_points`, times
each kind of exception, times each push) in the in-process engine and on rank 1 of the
tensor-parallel multi-process engine, and a checkpoint header that would only fail to parse
after the write, refused before it (FAULT INJECTION through the fault plugin)."""

from __future__ import annotations

import pytest
from faults import KINDS, fault_points
from helpers import run_script

# points where no byte has been written yet: the push must be refused, the engine on A, defined
UNWRITTEN = ("prepare:", "abandon:", "commit:enter", "writer:")
# a push of a file rolls back by re-reading the files served: it must end on A, defined
ROLLED_BACK = ("commit:return", "loader", "refresh", "prefix_reset", "fail:")
# which points each push must reach (a point it never reaches proves nothing)
REACHED = {
    "direct": ("writer:direct", "loader", "refresh"),
    "partial": ("writer:direct", "loader", "refresh"),
    "delta": ("writer:delta", "refresh"),
    "layerwise": ("writer:layerwise",),
    "vllm-direct": ("writer:vllm-direct", "loader"),
}
TP2_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "0|1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # only to send the test's digest function
}


def _judge(r: dict) -> None:
    a = r["states"]["A"]["digest"]
    wrong = []
    for c in r["cases"]:
        where = f"{c['push']} {c['point']} {c['kind']}: {c['error']} -> label {c['label']}"
        on_a = c["label"] == "A" and c["digest"] == a and c["undefined"] is None
        landed = c["label"] == c["version"] and c["digest"] == r["states"][c["push"]]["digest"]
        if c["point"].startswith(ROLLED_BACK):
            ok = on_a and c["error"] is not None  # rolled back: A's bits, A's label, defined
        elif c["point"].startswith(UNWRITTEN):  # refused; or survived (the start's ABANDON)
            ok = (on_a and c["error"] is not None) or (landed and c["error"] is None)
        else:  # a rollback or settle that failed: any outcome but bits apart from their label
            ok = (on_a and c["error"] is not None) or (landed and c["error"] is None)
            ok = ok or (
                c["undefined"] is not None and c["label"] is None and c["error"] is not None
            )
        if not c["fired"] and c["error"] is None and landed:
            ok = True  # a point this push does not reach (another writer's): a clean push
        if not ok:
            wrong.append(where)
    assert not wrong, "\n".join(wrong)
    for push, points in REACHED.items():
        fired = {c["point"] for c in r["cases"] if c["push"] == push and c["fired"]}
        phases = {p for p in fault_points() if p.split(":")[0] in ("prepare", "commit")}
        missing = (set(points) | phases) - fired if push in r["states"] else set()
        assert not missing, f"{push} never reached {sorted(missing)}"
    assert len(r["cases"]) == len(fault_points()) * len(KINDS) * (len(r["states"]) - 1)


def _judge_malformed(r: dict) -> None:
    """A fingerprint header that is not hex: refused by name before a byte is written."""
    for bad in ("malformed-M", "malformed-partial"):
        got = r[bad]
        assert got["error"] == "CheckpointError", got
        assert "not 16 hex digits" in got["message"], got
        assert got["label"] == "A" and got["undefined"] is None
        assert got["digest"] == r["states"]["A"]["digest"]


def _run_and_judge(models: dict, tmp_path, *args: str, **kwargs) -> None:
    a, b = str(models["llama_A"]), str(models["llama_B"])
    r, _ = run_script("fault_matrix.py", a, b, str(tmp_path), *args, **kwargs)
    _judge(r)
    _judge_malformed(r)


@pytest.mark.every_vllm
def test_fault_matrix_in_process(models, tmp_path) -> None:
    """Every writer the engine's vLLM has (vLLM's own direct reload from 0.34 on)."""
    import vllm

    pushes = "direct,partial,delta,layerwise"
    if tuple(int(x) for x in vllm.__version__.split(".")[:2]) >= (0, 34):
        pushes += ",vllm-direct"
    _run_and_judge(models, tmp_path, "--pushes", pushes, multiprocess=False)


@pytest.mark.slow
def test_fault_matrix_on_one_rank_of_the_tensor_parallel_multiprocess_engine(
    models, tmp_path
) -> None:
    """Rank 1 alone raises at each point; rank 0 must never wait on it, and both end alike."""
    args = ("--tp", "2", "--rank", "1", "--pushes", "direct,delta")
    _run_and_judge(models, tmp_path, *args, env=TP2_ENV)
