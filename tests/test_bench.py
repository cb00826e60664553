"""The benchmark runs end to end and writes complete, correct-by-construction results.

Only structure and the correctness check are asserted here: speed targets are the benchmark's
own business (it reports them met or missed), never a test's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMING_KEYS = ("median", "min", "max", "q1", "q3", "n", "samples")


def _timed(d: dict) -> None:
    assert "error" not in d, d.get("error")
    for key in TIMING_KEYS:
        assert key in d, key
    assert d["n"] >= 1 and d["median"] is not None


@pytest.mark.slow
def test_quick_bench_writes_complete_results(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the bench sets it per process itself
    cmd = [sys.executable, "-m", "benchmarks", "--quick", "--out", str(out)]
    cmd += ["--workdir", str(tmp_path / "work")]
    # benchmarks/ is not installed: run from the repository root, where it is importable
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])

    r = json.loads(out.read_text())
    assert out.with_suffix(".md").stat().st_size > 0
    assert out.with_suffix(".png").stat().st_size > 0
    assert "-m benchmarks" in r["command"] and "--quick" in r["command"]
    for key in ("cpu_model", "cores", "memory_total_bytes", "copy_bandwidth_bytes_per_s"):
        assert r["machine"].get(key) is not None, key
    for key in ("torch", "vllm", "weight-bridge"):
        assert r["versions"].get(key), key
    assert r["load"]["loadavg_start"] and r["errors"] == []
    assert r["correctness_passed"] is True

    size = r["sizes"]["1m"]
    ip, mp, save = size["inprocess"], size["multiprocess"], size["save"]
    for engine in (ip, mp):
        for key in (
            "copy",
            "read_copy",
            "direct",
            "direct_no_finite",
            "direct_verify_hash",
            "vllm_api_reload",
            "layerwise_file",
            "layerwise_iter",
            "naive_loop",
        ):
            _timed(engine[key])
        for key in ("read_s", "write_s", "refresh_s", "readback_s"):
            _timed(engine["direct"][key])
        for key in ("direct", "direct_glibc_malloc", "direct_cold_plan", "tiny"):
            _timed(engine["levers"][key])
        assert engine["levers"]["plan_cache_hit"] is True
        for probe in engine["memory"].values():
            assert probe["samples"] > 0
            assert probe["peak_extra_anon"] is not None and probe["peak_extra_file"] is not None
    _timed(ip["cold_restart"])
    # --quick leaves out the sections that start more engines (generation speed and vLLM's own
    # engine, vllm serve, FSDP2 jobs): make bench runs them
    assert "generation" not in mp and "http" not in mp and "fsdp" not in r
    pauses = r["inflight"]["pauses"]
    for mode in ("idle", "recompute", "keep", "drain"):
        assert pauses[mode]["n"] == 2 and 0 < pauses[mode]["median_s"] <= pauses[mode]["p95_s"]
    for where in ("disk", "shm"):
        _timed(save[where]["save_checkpoint"])
        _timed(save[where]["raw_write"])

    for engine_name in ("inprocess", "multiprocess"):
        for name in ("direct_vs_read_copy", "layerwise_vs_direct", "peak_anon_vs_largest"):
            assert size["ratios"][engine_name][name] is not None, (engine_name, name)
        for name in ("layerwise_vs_direct", "peak_anon_vs_largest"):
            assert size["targets"][f"{engine_name}.{name}"]["met"] in (True, False)
    for name in ("inprocess.cold_vs_direct", "save_vs_raw_disk", "save_vs_raw_shm"):
        assert size["targets"][name]["met"] in (True, False), name

    c = size["correctness"]
    assert c["passed"] is True and c["prompts_discriminate_A_from_B"] is True
    assert c["checks"]["direct_inprocess"]["match"] is True
    assert c["checks"]["direct_multiprocess"]["match"] is True
