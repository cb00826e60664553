"""The engine inside the trainer's ranks (``EngineSpec(mode="ranks")``): a real Lightning
``Trainer`` on two ranks under ``torchrun``, vLLM tensor-parallel over them with its external
launcher, pushed from the live tensors (``tests/ranks_sync_check.py``).

After every sync (a complete one, then partial ones: the embeddings are frozen) each rank's
engine must equal a cold TP=2 engine on the trainer's full weights; both ranks generate the same
tokens; a refusal on one rank (a NaN in what it writes, a tensor of the wrong shape, a stale
base) is a typed refusal on both, nothing written; a tensor that produces another shape than it
declares is refused by name mid-write and rolled back on both; a failure after rank 0 committed
(rank 1's refresh raises, FAULT INJECTION) rolls both back: the label and the tokens as before,
no rank undefined.
Under DDP and FSDP2 on one "node" (TP=2; the two jobs at the same time), and as two "nodes" of
one process each (one engine per node, TP=1) with PEFT LoRA (merged by the callback; the
reference merged by PEFT).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FAULT_PARAM, TESTS, assert_differs, assert_parity

pytestmark = [pytest.mark.slow, pytest.mark.every_vllm]  # both vLLMs (0.34: issue 58)

RUN_TIMEOUT_S = 600


def launch(model: Path, out: Path, strategy: str, nodes: int, *extra: str) -> list:
    """Start the two-rank job under torchrun (one launcher per "node", on the loopback)."""
    out.mkdir()
    script = [str(TESTS / "ranks_sync_check.py"), str(model), str(out), "--strategy", strategy]
    script += extra
    port = str(_free_port())
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={nodes}",
                f"--nproc_per_node={2 // nodes}",
                f"--node_rank={node}",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                *script,
            ],
            env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in range(nodes)
    ]


def reports(launchers: list, out: Path) -> list[dict]:
    """Wait for a job; each rank's report."""
    outputs = [p.communicate(timeout=RUN_TIMEOUT_S)[0] for p in launchers]
    for p, output in zip(launchers, outputs, strict=True):
        assert p.returncode == 0, output[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_jobs_at_once_each_with_an_engine_in_its_ranks_ddp_and_fsdp2(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """A DDP job and an FSDP2 job (with files asked for) on one machine at the same time, each
    with TP=2 engines in its ranks: their engines do not meet (vLLM named every external
    launcher's CPU shared memory alike; the second to start failed with errno 17)."""
    jobs = {
        ("ddp",): launch(models["llama_A"], tmp_path / "ddp", "ddp", 1),
        ("fsdp", "--files"): launch(models["llama_A"], tmp_path / "fsdp", "fsdp", 1, "--files"),
    }
    try:
        for (strategy, *extra), launchers in jobs.items():
            check(reports(launchers, tmp_path / strategy), tuple(extra))
    finally:  # a failed job's partner is not left running
        for launchers in jobs.values():
            for p in launchers:
                if p.poll() is None:
                    p.kill()
                    p.communicate()


def test_two_nodes_with_lora(models: dict[str, Path], tmp_path: Path) -> None:
    """Two "nodes" of one process each: one engine per node (TP=1), PEFT LoRA merged."""
    launchers = launch(models["llama_A"], tmp_path / "out", "ddp", 2, "--lora")
    check(reports(launchers, tmp_path / "out"), ("--lora",))


def test_an_fsdp2_push_holds_a_tensor_at_a_time_not_the_model(tmp_path: Path) -> None:
    """FSDP2 (really sharded: ``fully_shard`` on the data-parallel mesh) into the engine in the
    ranks, a 30m Llama (109 MB, largest tensor 16 MiB): each sync's peak extra memory on each
    rank (``tests/ranks_memory_check.py``: the allocator's live bytes, sampled) is at most two
    full tensors and a 16 MiB buffer, the first sync's beside the host store it allocates
    once (the rollback source, one copy of the rank's shard, in host memory). Checked on the
    commit before: every sync held the whole model gathered plus its pre-images (164 MB)."""
    from weight_bridge.testing.models import build_tiny_model

    model = build_tiny_model(tmp_path / "model", size="30m", seed=0, tie_word_embeddings=False)
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
    cmd += ["--master_addr=127.0.0.1", f"--master_port={_free_port()}"]
    cmd += [str(TESTS / "ranks_memory_check.py"), str(model), str(out)]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    job = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert job.returncode == 0, (job.stdout + job.stderr)[-6000:]
    for rank in (0, 1):
        got = json.loads((out / f"memory{rank}.json").read_text())
        bound = 2 * got["largest"] + 16 * 2**20
        first, *later = got["peaks"]
        assert len(later) == 3 and all(peak <= bound for peak in later), (got, bound)
        assert 0.45 * got["model"] <= got["store"] <= 0.55 * got["model"], got  # its shard
        assert first <= got["store"] + bound, (got, bound)


def check(ranks: list[dict], extra: tuple) -> None:
    """Every sync equal to its cold start on both ranks, the refusal and the faults."""
    first, second = ranks
    pushes = first["pushes"]
    assert [p["step"] for p in pushes] == [0, 1, 2]
    assert [p["version"] for p in pushes] == [0, 1, 2]
    assert [p["partial"] for p in pushes] == [False, True, True]  # frozen embeddings left out
    # no file on the way: pushed as tensors in memory
    assert [p["checkpoint"] for p in pushes] == [
        f"tensors in memory, version {i}" for i in range(3)
    ]
    if "--files" in extra:  # files asked for: each sync also saved, complete, the newest 2 kept
        assert first["files"] == ["step-00000001.safetensors", "step-00000002.safetensors"]
        assert first["last_checkpoint"].endswith("step-00000002.safetensors")
        assert first["last_file_equal"]  # the trainer's full weights at that step, bit for bit
    else:
        assert first["last_checkpoint"] is None
    for p in pushes:
        assert_parity(p["greedy"], first["cold"][str(p["step"])])
    assert [p["greedy"] for p in second["pushes"]] == [p["greedy"] for p in pushes]
    assert_differs(pushes[-1]["greedy"], pushes[0]["greedy"])  # training changed the weights
    for rank in ranks:
        refused = rank["refused"]
        assert refused["error"] == "DirectReloadError", refused
        assert "nothing was written" in refused["message"]
        assert "NaN" in refused["problems"]["model.layers.0.mlp.down_proj.weight"]
        assert rank["after_refusal"]
        wrong = rank["wrong_shape"]  # rank 1's tensor alone is wrong: both refuse, naming it
        assert wrong["error"] == "DirectReloadError" and "nothing was written" in wrong["message"]
        assert "model.layers.0.mlp.down_proj.weight" in wrong["message"], wrong
        produced = rank["wrong_produced"]  # rank 1 alone: a row produced for a declared matrix
        assert produced["error"] == "DirectReloadError", produced
        assert FAULT_PARAM in produced["message"], produced
        assert "produced" in produced["message"], produced  # its error, or the one it caused
        assert rank["after_wrong_produced"], "a refused produced tensor changed the engine"
        meta = rank["meta"]  # rank 1 alone hands a tensor on the meta device: refused by name
        assert meta["error"] == "CheckpointError", meta
        assert "meta device" in meta["message"], meta
        assert rank["after_meta"], "a refused meta tensor changed the engine"
        assert_parity(rank["submitted"], rank["generated"])  # submit: on the rank's thread
        matrix = rank["matrix"]  # every fault point, every kind, on each rank: one outcome
        assert matrix["cases"] == matrix["points"] * 3 and not matrix["bad"], matrix
        reached = {"prepare:enter", "commit:enter", "writer:direct", "loader", "store_refresh"}
        if "--files" in extra:  # FSDP2: pushed from the DTensors, gathered as the loader asks
            reached |= {"gather:enter", "gather:return"}
        assert reached <= set(matrix["fired"]), matrix["fired"]  # struck on this rank too
        assert rank["store_after_layerwise"]  # the file's bits under its label, not the store's
        stale = rank["stale_base"]  # rank 1 alone names a base the engine does not serve
        assert stale["error"] == "BaseVersionError", stale
        assert "nothing was written" in stale["message"], stale
        assert rank["after_other_refusals"]
        failed = rank["after_commit"]
        assert failed["error"] == "DirectReloadError", failed
        assert "injected fault" in failed["message"]
        assert "rolled back to version '2'" in failed["message"]
        assert rank["after_rollback"] and rank["undefined"] is None
        failed = rank["partial_after_commit"]  # the same for a partial push
        assert failed["error"] == "DirectReloadError" and "injected fault" in failed["message"]
        assert "rolled back to version '2'" in failed["message"], failed
        assert rank["after_partial_rollback"]
        # rank 1 alone: mid-write, read-back, the prefix-cache reset; complete and partial
        for kind in (f"{k}{p}" for k in ("raise", "clobber", "cache") for p in ("", "_partial")):
            failed = rank[f"fault_{kind}"]
            assert failed["error"] == "DirectReloadError", (kind, failed)
            assert "rolled back to version '2'" in failed["message"], (kind, failed)
            assert rank[f"after_fault_{kind}"], kind
        for attempt in (1, 2):  # one source object, pushed again after each failure
            failed = rank[f"reused_fault_{attempt}"]
            assert failed["error"] == "DirectReloadError", (attempt, failed)
            assert "rolled back to version '2'" in failed["message"], (attempt, failed)
        assert rank["reused_lands"] == {"error": None} and rank["after_reused"]
        assert rank["after_reused_back"]
