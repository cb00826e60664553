"""Key torch's compile caches by the CPU's vector ISA (the plugin applies it in every process).

Why: vLLM's CPU sampler computes logprobs with functions Inductor compiles
(``vllm/v1/worker/cpu/logprob.py``: ``compute_token_logprobs``, ``_compute_token_ranks``), and
Inductor tiles their loops for the vector width it picks from torch's CPU flags
(``torch/_inductor/cpu_vec_isa.py:pick_vec_isa``). Its FX graph cache key
(``torch/_inductor/codecache.py:FxGraphHashDetails``) does not contain that ISA, but the C++
build does, so a process on another ISA than the one that filled the cache compiles the other
width's tiling: the ``logsumexp`` then covers part of the vocabulary and logprobs are far off
(greedy tokens, from an eager ``argmax``, stay right). This hits a cache shared between ISAs: a
shared or baked-in ``TORCHINDUCTOR_CACHE_DIR``, or one machine run with and without
``ATEN_CPU_CAPABILITY`` (``docs/tests.md``). It is not a vLLM bug.

Fix: :func:`apply` puts the inputs of Inductor's ISA choice into
``torch.compiler.config.cache_key_tag``, torch's own knob for extra cache-key text, which both the
FX graph cache and the AOTAutograd cache include. Each ISA gets its own entries; generated code
does not change; an existing cache misses once per graph. It must run in every process that
compiles, before its first compile: vLLM runs :func:`weight_bridge.vllm.plugin.register` in every
process it starts, before any model runner exists.

Not covered: vLLM's own compile cache of the model (``enforce_eager=False``), keyed by
``vllm/compilation/compiler_interface.py:get_inductor_factors``, not by this tag.
"""

from __future__ import annotations

import os
import platform

TAG_PREFIX = "cpu-vec-isa:"

# What torch/_inductor/cpu_vec_isa.py reads to pick the ISA (x86_isa_checker, VecAVX512's bf16
# check, VecAMX), by the names of torch.cpu's checks.
_FLAGS = ("avx2", "avx512", "avx512_bf16", "vnni", "avx512_vnni", "amx_tile", "amx_fp16")


def isa_tag() -> str:
    """The inputs of Inductor's ISA choice in this process, as one cache-key tag."""
    import torch

    flags = [
        name
        for name in _FLAGS
        if callable(check := getattr(torch.cpu, f"_is_{name}_supported", None)) and check()
    ]
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "")
    return f"{TAG_PREFIX}{platform.machine()}[{','.join(flags)}]aten={capability}"


def apply() -> str:
    """Add :func:`isa_tag` to ``torch.compiler.config.cache_key_tag``, replacing an earlier one
    and keeping any other tag. Returns the new tag. Idempotent."""
    import torch.compiler.config as compiler_config

    kept = [
        part
        for part in compiler_config.cache_key_tag.split("|")
        if part and not part.startswith(TAG_PREFIX)
    ]
    compiler_config.cache_key_tag = "|".join([*kept, isa_tag()])
    return compiler_config.cache_key_tag
