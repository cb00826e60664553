"""The bits an adapter push puts in a LoRA slot are vLLM's own, without an engine.

vLLM loads a PEFT directory with ``LoRAModel.from_local_checkpoint`` (A and B cast to the LoRA
dtype), packs the slices of a fused layer (``PackedLoRALayerWeights.pack``) and folds the
scaling into B (``LoRALayerWeights.optimize``): that, called here on the same directory, is the
reference. The bridge's :func:`slot_tensors` (cast, then scale) and :func:`slot_map` (PEFT
module -> engine layer and slice, through vLLM's parser and Llama's packed-module table) must
give bitwise the same tensor for every module and slice, in fp32, bf16 and fp16, with rsLoRA
and per-module rank/alpha patterns. The other order (scale, then cast) differs in bf16: the
check catches it. CPU only, runs under every vLLM the project supports.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from weight_bridge.checkpoint import CheckpointError
from weight_bridge.checkpoint.adapter import AdapterConfig, adapter_part, read_adapter
from weight_bridge.direct import DirectReloadError
from weight_bridge.direct.adapter_slots import slot_map, slot_tensors
from weight_bridge.testing.adapters import build_peft_adapter
from weight_bridge.testing.models import build_tiny_model

lora_model = pytest.importorskip("vllm.lora.lora_model")
from vllm.lora.lora_weights import PackedLoRALayerWeights  # noqa: E402
from vllm.lora.peft_helper import PEFTHelper  # noqa: E402
from vllm.lora.utils import parse_fine_tuned_lora_name  # noqa: E402
from vllm.model_executor.models.llama import LlamaForCausalLM  # noqa: E402

LAYERS = 2  # the tiny Llama's
PACKED = LlamaForCausalLM.packed_modules_mapping
EXPECTED = {"o_proj", "down_proj", *PACKED, *(m for ms in PACKED.values() for m in ms)}

ADAPTERS = {
    "plain": {},
    "rslora": {"use_rslora": True},
    "patterns": {"rank_pattern": {"v_proj": 4}, "alpha_pattern": {"o_proj": 7, "up_proj": 5}},
    "attention-only": {"targets": ("q_proj", "v_proj", "o_proj")},
}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    base = build_tiny_model(root / "llama", arch="llama", seed=0)
    return {
        name: build_peft_adapter(base, root / name, seed=i + 1, **config)
        for i, (name, config) in enumerate(ADAPTERS.items())
    }


def engine_layers() -> tuple[set[str], dict[str, list[str]]]:
    """The tiny Llama's LoRA layers and packed table, full names, as vLLM's manager records
    them (verified on a live engine: /tmp/lora-verify.md)."""
    layers, packed = set(), {}
    for i in range(LAYERS):
        prefix = f"model.layers.{i}"
        for layer, group in (("self_attn", "qkv_proj"), ("mlp", "gate_up_proj")):
            packed[f"{prefix}.{layer}.{group}"] = [f"{prefix}.{layer}.{m}" for m in PACKED[group]]
        layers |= {f"{prefix}.self_attn.o_proj", f"{prefix}.mlp.down_proj", *packed}
    return layers, packed


def vllm_load(path: Path, dtype: torch.dtype) -> dict:
    """vLLM's own load of ``path``: read and cast, pack the fused layers, fold the scaling."""
    helper = PEFTHelper.from_local_dir(str(path), max_position_embeddings=128)
    model = lora_model.LoRAModel.from_local_checkpoint(
        str(path), EXPECTED, helper, lora_model_id=1, device="cpu", dtype=dtype
    )
    _, packed = engine_layers()
    for layer, parts in packed.items():
        loras = [model.loras.get(p) for p in parts]
        if any(lora is not None for lora in loras):
            model.loras[layer] = PackedLoRALayerWeights.pack(loras)
            for p in parts:
                model.loras.pop(p, None)
    for lora in model.loras.values():
        lora.optimize()
    return model.loras


def bridge_slots(path: Path, dtype: torch.dtype, order: str = "cast-then-scale") -> dict:
    """The bridge's slot tensors for ``path``: ``{layer: [(A, B) or None per slice]}``."""
    config, tensors = read_adapter(path)
    layers, packed = engine_layers()
    parts = slot_map(
        tensors, parse_fine_tuned_lora_name, layers, packed, lambda n: adapter_part(n)[0]
    )
    out: dict[str, list] = {}
    for layer, slices in parts.items():
        out[layer] = []
        for part in slices:
            if part is None:
                out[layer].append(None)
                continue
            a, b = tensors[part.a_name], tensors[part.b_name]
            scaling = config.scaling(part.peft_module)
            if order == "cast-then-scale":
                out[layer].append(slot_tensors(a, b, scaling, dtype))
            else:  # the mutant: scale in the source dtype, then cast
                out[layer].append((a.to(dtype), (b * scaling).to(dtype)))
    return out


def mismatches(path: Path, dtype: torch.dtype, order: str = "cast-then-scale") -> list[str]:
    ref, ours = vllm_load(path, dtype), bridge_slots(path, dtype, order)
    assert sorted(ref) == sorted(ours), "the layers the adapter targets"
    bad = []
    for layer, slices in ours.items():
        packed = isinstance(ref[layer], PackedLoRALayerWeights)
        ref_a = ref[layer].lora_a if packed else [ref[layer].lora_a]
        ref_b = ref[layer].lora_b if packed else [ref[layer].lora_b]
        assert len(ref_a) == len(slices), layer
        for i, got in enumerate(slices):
            if got is None or ref_a[i] is None:
                assert got is None and ref_a[i] is None, f"{layer}[{i}]: targeted by one only"
                continue
            for what, mine, theirs in (("A", got[0], ref_a[i]), ("B", got[1], ref_b[i])):
                assert mine.dtype == theirs.dtype == dtype
                if not torch.equal(mine, theirs):
                    bad.append(f"{layer}[{i}].{what}")
    return bad


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_slot_tensors_equal_vllm_load(adapters, adapter: str, dtype: torch.dtype) -> None:
    assert mismatches(adapters[adapter], dtype) == []


def test_scale_then_cast_is_caught(adapters) -> None:
    """The order mutant: in bf16, scaling before the cast changes B's bits (not A's)."""
    bad = mismatches(adapters["plain"], torch.bfloat16, order="scale-then-cast")
    assert bad and all(b.endswith(".B") for b in bad), bad


def test_slot_map_matches_vllm_packing(adapters) -> None:
    """Every PEFT module lands in vLLM's layer and slice; an untargeted slice stays empty."""
    _, tensors = read_adapter(adapters["attention-only"])
    layers, packed = engine_layers()
    parts = slot_map(
        tensors, parse_fine_tuned_lora_name, layers, packed, lambda n: adapter_part(n)[0]
    )
    qkv = parts["model.layers.1.self_attn.qkv_proj"]
    assert [p and (p.slice, p.peft_module) for p in qkv] == [
        (0, "model.layers.1.self_attn.q_proj"),
        None,
        (2, "model.layers.1.self_attn.v_proj"),
    ]
    assert parts["model.layers.0.self_attn.o_proj"][0].slice == 0  # type: ignore[union-attr]
    assert not any("mlp" in layer for layer in parts)


def test_slot_map_refusals_name_the_tensor(adapters) -> None:
    _, tensors = read_adapter(adapters["plain"])
    layers, packed = engine_layers()
    names = [n for n in tensors if "layers.0.self_attn.q_proj.lora_B" not in n]
    names.append("base_model.model.model.layers.0.self_attn.rotary.lora_A.weight")
    with pytest.raises(DirectReloadError) as info:
        slot_map(names, parse_fine_tuned_lora_name, layers, packed, lambda n: adapter_part(n)[0])
    problems = info.value.problems
    assert problems == {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (
            "model.layers.0.self_attn.q_proj has only lora_A"
        ),
        "base_model.model.model.layers.0.self_attn.rotary.lora_A.weight": (
            "model.layers.0.self_attn.rotary has only lora_A"
        ),
    }


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("use_dora", True, "DoRA"),
        ("bias", "lora_only", "biases"),
        ("modules_to_save", ["lm_head"], "modules_to_save"),
        ("layer_replication", [[0, 2]], "layer_replication"),
        ("r", 0, "rank"),
    ],
)
def test_config_refusals_are_named(field: str, value: object, named: str) -> None:
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, field: value}
    with pytest.raises(CheckpointError, match=named) as info:
        AdapterConfig.from_dict(config, "adapter_config.json")
    assert isinstance(info.value, ValueError)


def test_embedding_adapter_refused_by_name() -> None:
    name = "base_model.model.model.embed_tokens.lora_embedding_A"
    with pytest.raises(CheckpointError, match="embedding") as info:
        adapter_part(name)
    assert info.value.tensor == name


def test_scaling_follows_peft_patterns() -> None:
    config = AdapterConfig.from_dict(
        {"r": 8, "lora_alpha": 16, "rank_pattern": {"v_proj": 4}, "alpha_pattern": {"o_proj": 2}},
        "adapter_config.json",
    )
    assert config.scaling("model.layers.0.self_attn.q_proj") == 2.0
    assert config.scaling("model.layers.0.self_attn.v_proj") == 4.0
    assert config.scaling("model.layers.0.self_attn.o_proj") == 0.25
    assert config.rank("model.layers.3.self_attn.v_proj") == 4
    rs = AdapterConfig.from_dict({"r": 16, "lora_alpha": 8, "use_rslora": True}, "x")
    assert rs.scaling("model.layers.0.mlp.up_proj") == 2.0
