"""Key torch's compile caches by the CPU's vector ISA (the plugin applies it in every process).

This fixes the "wrong logprobs without AVX-512" of ../shared/wheels/README.md (issue 58, item 5).
It is not a vLLM bug, and nothing specific to AVX2 or to the wheel's ``_C_AVX2``.

**Cause** (torch 2.14.0, vLLM 0.34.0, CPU). vLLM's standalone CPU sampler computes logprobs
with functions compiled by Inductor: ``vllm/v1/worker/cpu/logprob.py``,
``compute_token_logprobs`` (``@torch.compile(dynamic=True, backend=
current_platform.simple_compile_backend)``, which is ``"inductor"``: a gather, then
``logsumexp``) and ``_compute_token_ranks``. Greedy tokens come from an eager ``argmax``
(``sampler.py``), so they stay right. Inductor writes C++ whose loops are tiled for the vector
width it picks from torch's CPU flags (``torch/_inductor/cpu_vec_isa.py:pick_vec_isa``: 16
floats a step on AVX-512, 8 on AVX2). It then stores that source in its FX graph cache
(``/tmp/torchinductor_<user>/fxgraph``, with the AOTAutograd cache beside it). The cache key
(``torch/_inductor/codecache.py:FxGraphHashDetails``: the graph, torch's version, Inductor's
config, the thread count) does **not** contain the ISA. The C++ build that follows does
(``-mavx2 -DCPU_CAPABILITY_AVX2`` or the AVX-512 flags), so a process whose ISA differs from
the process that filled the cache compiles the other ISA's tiling against its own
``at::vec::Vectorized<float>``. AVX-512 tiling under AVX2: each 16-float step loads and stores
8 lanes (``loadu``/``store`` clamp the count to the vector size). The max and the sum of the
``logsumexp`` then cover half of the vocabulary, and the last pass writes the normalizer of 8
rows out of each 16, leaving the others as raw partial sums. Reported logprobs end up tens of
nats off, some above 0. AVX2 tiling under AVX-512 zero-fills 8 lanes: smaller errors, still
wrong.

The README's simulation (a ``sitecustomize.py`` forcing torch's AVX-512 flags off) ran on a
machine whose cache the AVX-512 runs had already filled, so it hit exactly this. With a fresh
cache (``TORCHINDUCTOR_CACHE_DIR``), the forced no-AVX-512 path matches Hugging Face within
3e-6 (``tools/logprob_probe.py``). A real AVX2-only machine with its own cache is not affected.
A cache shared between machines of different ISAs is: a shared or baked-in
``TORCHINDUCTOR_CACHE_DIR``, or one machine run with and without ``ATEN_CPU_CAPABILITY``.

**Fix** (:func:`weight_bridge.vllm.plugin.register` calls it): :func:`apply` puts the inputs of
Inductor's ISA choice into ``torch.compiler.config.cache_key_tag``. That is torch's own knob for
extra cache-key text, and both the FX graph cache and the AOTAutograd cache include it
(``FxGraphHashDetails.cache_key_tag``; ``AOTAutogradCacheDetails`` derives from it). Each ISA
then gets its own entries. Generated code does not change. The cost is a few flag reads, no
compile. An existing cache misses once per graph. It must run in every process that compiles,
before its first compile: vLLM runs :func:`weight_bridge.vllm.plugin.register` in every process
it starts, before any model runner exists.

Not covered: vLLM's own compile cache of the model (``enforce_eager=False``,
``~/.cache/vllm/torch_compile_cache``). vLLM keys it by
``vllm/compilation/compiler_interface.py:get_inductor_factors`` (system, torch's key,
Inductor's config), not by this tag. Setting ``torch._inductor.config.cpp.simdlen`` to the
picked ISA's width would enter those factors, but picking costs seconds of test builds. This
has not been tried.
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
