"""Scale-out on this machine: vLLM tensor parallelism (TP=2 on two CPU cores)."""

from __future__ import annotations

import pytest
from conftest import assert_parity, run_engine_check

TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tensor_parallel_push_matches_tensor_parallel_cold_start(arch, models) -> None:
    """Each rank records its own layout, reads the file itself and keeps only its shard."""
    a, b = models[f"{arch}_A"], models[f"{arch}_B"]
    r = run_engine_check("push", str(a), str(b), "--tp", "2", env=TP2_ENV)
    assert r["workers"] == 2
    assert r["reports"][0]["workers"] == 2
    assert_parity(r["b_pushed"], r["b_cold"])
    assert_parity(r["a_pushed"], r["a_before"])
    assert r["b_pushed"] != r["a_before"]
    assert r["addresses_unchanged"]
