"""Colocated memory: the engine leaves room for the trainer (``weight_bridge.vllm.clients.memory``).

The keyword rules are checked directly (no engine). The slow test starts a ``ColocatedEngine``
from a plain Python script in a clean environment (no ``VLLM_CPU_KVCACHE_SPACE``, none of the
Makefile's variables), as a user's own program would, and measures the engine processes' resident
memory: before the colocated default, that engine took about 21 GB of this 24 GB machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from helpers import result_of

from weight_bridge.testing import real_model
from weight_bridge.vllm.clients.memory import (
    CPU_DEFAULT_KV_CACHE_GB,
    CUDA_COLOCATED_UTILIZATION,
    KVCacheTooSmallWarning,
    colocated_llm_kwargs,
    kv_bytes_per_token,
)

GiB = 1 << 30


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A config-only model directory: 4 layers, 2 KV heads of 64, float32."""
    config = dict(
        architectures=["LlamaForCausalLM"],
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=256,
        max_position_embeddings=2048,
        dtype="float32",
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def cpu(model: Path, kwargs: dict, env: dict | None = None, **kw) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning unless a test expects one
        return colocated_llm_kwargs(model, kwargs, device="cpu", environ=env or {}, **kw)


def test_cpu_default_is_a_small_kv_cache(model: Path) -> None:
    kwargs = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 8}
    out = cpu(model, kwargs)
    assert out == {**kwargs, "kv_cache_memory_bytes": int(CPU_DEFAULT_KV_CACHE_GB * GiB)}
    assert kwargs == {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 8}  # not mutated


def test_the_knob_sets_the_kv_cache_on_every_backend(model: Path) -> None:
    kwargs = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 8}
    assert cpu(model, kwargs, kv_cache_gb=0.5)["kv_cache_memory_bytes"] == GiB // 2
    cuda = colocated_llm_kwargs(model, kwargs, kv_cache_gb=2, device="cuda", environ={})
    assert cuda["kv_cache_memory_bytes"] == 2 * GiB
    with pytest.raises(ValueError, match="not both"):
        cpu(model, {"kv_cache_memory_bytes": GiB}, kv_cache_gb=1)
    with pytest.raises(ValueError, match="positive"):
        cpu(model, {}, kv_cache_gb=0)


def test_explicit_settings_win(model: Path) -> None:
    small = {"max_model_len": 256, "max_num_seqs": 8}
    assert cpu(model, {**small, "kv_cache_memory_bytes": 123 << 20})["kv_cache_memory_bytes"] == (
        123 << 20
    )
    # vLLM's own CPU sizing by fraction, asked for explicitly: left to vLLM.
    assert "kv_cache_memory_bytes" not in cpu(model, {**small, "gpu_memory_utilization": 0.2})
    # The environment variable vLLM reads: untouched, no keyword added.
    assert cpu(model, small, env={"VLLM_CPU_KVCACHE_SPACE": "2"}) == small
    with pytest.warns(UserWarning, match="VLLM_CPU_KVCACHE_SPACE=2 in the environment overrides"):
        colocated_llm_kwargs(
            model, small, kv_cache_gb=1, device="cpu", environ={"VLLM_CPU_KVCACHE_SPACE": "2"}
        )


def test_cuda_defaults_to_a_colocated_fraction(model: Path) -> None:
    out = colocated_llm_kwargs(model, {}, device="cuda", environ={})
    assert out == {"gpu_memory_utilization": CUDA_COLOCATED_UTILIZATION}
    mine = colocated_llm_kwargs(model, {"gpu_memory_utilization": 0.8}, device="cuda", environ={})
    assert mine == {"gpu_memory_utilization": 0.8}


def test_warns_when_the_kv_cache_cannot_hold_every_sequence(model: Path) -> None:
    per_token = kv_bytes_per_token(model, {"dtype": "float32"})
    assert per_token == 2 * 4 * 2 * 64 * 4  # K and V, layers, KV heads, head dim, float32
    assert kv_bytes_per_token(model, {"dtype": "bfloat16"}) == per_token // 2
    assert kv_bytes_per_token(model, {"dtype": "float32", "tensor_parallel_size": 2}) == (
        per_token // 2
    )
    # 1 GiB holds 262144 tokens of 4 KiB: 8 x 2048 fits, 256 x 2048 (vLLM's defaults) does not.
    cpu(model, {"dtype": "float32", "max_model_len": 2048, "max_num_seqs": 8})
    with pytest.warns(KVCacheTooSmallWarning, match=r"256 x 2048 = 524288"):
        colocated_llm_kwargs(model, {"dtype": "float32"}, device="cpu", environ={})
    with pytest.warns(KVCacheTooSmallWarning, match="VLLM_CPU_KVCACHE_SPACE=1"):
        colocated_llm_kwargs(
            model,
            {"dtype": "float32", "max_model_len": 2048, "max_num_seqs": 256},
            device="cpu",
            environ={"VLLM_CPU_KVCACHE_SPACE": "1"},
        )


def test_no_estimate_without_a_local_config(tmp_path: Path) -> None:
    assert kv_bytes_per_token(tmp_path / "missing", {}) is None
    assert cpu(tmp_path / "missing", {}) == {"kv_cache_memory_bytes": GiB}


USER_SCRIPT = """
import json, sys
import psutil
from vllm import SamplingParams
from weight_bridge import ColocatedEngine

def peak_rss(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))

def main():
    # enforce_eager only keeps the test short (no torch.compile); memory is not its reason.
    with ColocatedEngine(sys.argv[1], dtype="float32", max_model_len=512, max_num_seqs=16,
                         enforce_eager=True) as engine:
        engine.generate(["Tell me a story."] * 16, SamplingParams(max_tokens=32))
        me = psutil.Process()
        engine_procs = me.children(recursive=True)
        cache = engine.llm.llm_engine.vllm_config.cache_config
        print("RESULT " + json.dumps({
            "script_rss": me.memory_info().rss,
            "engine_rss": sum(p.memory_info().rss for p in engine_procs),
            "engine_peak_rss": sum(peak_rss(p.pid) for p in engine_procs),
            "engine_processes": [p.name() for p in engine_procs],
            "kv_cache_memory_bytes": cache.kv_cache_memory_bytes,
            "kv_blocks": cache.num_gpu_blocks,
            "block_size": cache.block_size,
            "total_memory": psutil.virtual_memory().total,
        }))

if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
@pytest.mark.skipif(real_model.available() is not None, reason=str(real_model.available()))
def test_plain_script_engine_stays_within_its_budget(tmp_path: Path) -> None:
    model = real_model.real_model_dir()
    script = tmp_path / "user_script.py"
    script.write_text(USER_SCRIPT)
    env = {  # a clean environment: no VLLM_* variables, nothing from the Makefile
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", str(tmp_path)),
        "HF_HUB_OFFLINE": "1",
    }
    proc = subprocess.run(
        [sys.executable, str(script), str(model)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    r = result_of(proc)

    kv = int(CPU_DEFAULT_KV_CACHE_GB * GiB)
    assert r["kv_cache_memory_bytes"] == kv
    # The worker really sized its KV cache to that: blocks x tokens x bytes per token.
    per_token = kv_bytes_per_token(model, {"dtype": "float32"})
    assert per_token is not None
    assert 0.9 * kv <= r["kv_blocks"] * r["block_size"] * per_token <= kv
    # The budget: the KV cache, the weights twice (cpu_linear="repack" keeps each linear beside
    # its packed copy) and 1.25 GiB per engine process (Python, torch, vLLM).
    weights = (model / "model.safetensors").stat().st_size
    workers = [n for n in r["engine_processes"] if "EngineCore" in n or "Worker" in n]
    assert workers, r["engine_processes"]
    budget = kv + 2 * weights + 1.25 * GiB * len(workers)
    print(
        f"\nengine processes {r['engine_processes']}: RSS {r['engine_rss'] / GiB:.2f} GiB, "
        f"peak {r['engine_peak_rss'] / GiB:.2f} GiB, budget {budget / GiB:.2f} GiB "
        f"(script itself {r['script_rss'] / GiB:.2f} GiB, "
        f"machine {r['total_memory'] / GiB:.1f} GiB)"
    )
    assert r["engine_peak_rss"] <= budget
    assert r["engine_peak_rss"] + r["script_rss"] < 0.5 * r["total_memory"]
