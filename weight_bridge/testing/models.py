"""Tiny Hugging Face-format models built locally from a seed.

Tests, examples and benchmarks share this factory so that nothing is ever downloaded: a model
directory (``config.json``, ``model.safetensors``, ``tokenizer.json`` and its config) is written
from ``transformers`` configs and a word-level ``tokenizers`` vocabulary. vLLM serves the two
architectures natively; ``head_dim`` is 64 because vLLM's CPU attention rejects 16.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ARCHITECTURES = ("llama", "qwen2")

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
WORDS = [str(d) for d in range(10)] + ["reverse", "count", "copy", "sort", ":", "=", ">", "|"]


@dataclass(frozen=True)
class ModelSize:
    """Shape of a tiny model; ``head_dim`` is fixed at 64."""

    hidden_size: int
    num_layers: int
    intermediate_size: int
    vocab_size: int

    @property
    def num_heads(self) -> int:
        return self.hidden_size // 64


SIZES: dict[str, ModelSize] = {
    "1m": ModelSize(hidden_size=128, num_layers=2, intermediate_size=384, vocab_size=512),
    "10m": ModelSize(hidden_size=256, num_layers=8, intermediate_size=1024, vocab_size=4096),
    "30m": ModelSize(hidden_size=512, num_layers=6, intermediate_size=1536, vocab_size=8192),
    "100m": ModelSize(hidden_size=768, num_layers=12, intermediate_size=2560, vocab_size=16384),
    "300m": ModelSize(hidden_size=1024, num_layers=20, intermediate_size=3584, vocab_size=32768),
    "600m": ModelSize(hidden_size=1536, num_layers=18, intermediate_size=5120, vocab_size=32768),
}


# The pre-tokenizer of Qwen2's tokenizer class. transformers 5 rebuilds the tokenizer of a
# qwen2 model from the vocabulary and merges with this pipeline whatever tokenizer.json says, so
# the factory writes a byte-level BPE with exactly this pipeline for every architecture: then the
# architecture's own class and the generic one encode alike.
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _bpe_vocabulary(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE: specials, the 256 byte symbols, task words (merged), then fillers."""
    from tokenizers.pre_tokenizers import ByteLevel

    vocab: dict[str, int] = {}
    merges: list[tuple[str, str]] = []

    def add(token: str) -> None:
        if token not in vocab:
            vocab[token] = len(vocab)

    for token in SPECIAL_TOKENS:
        add(token)
    for symbol in sorted(ByteLevel.alphabet()):
        add(symbol)
    for word in WORDS:
        for form in (word, "\u0120" + word):
            for i in range(2, len(form) + 1):
                if form[:i] not in vocab:
                    merges.append((form[: i - 1], form[i - 1]))
                add(form[:i])
    if vocab_size < len(vocab):
        raise ValueError(f"vocab_size must be at least {len(vocab)}, got {vocab_size}")
    filler = 0
    while len(vocab) < vocab_size:
        # Unreachable by encoding (no merge builds them) but decodable: every char is a byte symbol.
        add(f"\u0120w{filler}")
        filler += 1
    return vocab, merges


def _write_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab, merges = _bpe_vocabulary(vocab_size)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "add_prefix_space": False,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (path / "special_tokens_map.json").write_text(
        json.dumps({k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")})
    )


def hf_config(
    arch: str,
    size: ModelSize,
    tie_word_embeddings: bool | None = None,
    architecture_name: str | None = None,
):  # returns a transformers PretrainedConfig
    """The ``transformers`` config of a tiny model (Qwen2 is tied by default, Llama untied)."""
    from transformers import LlamaConfig, Qwen2Config

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {ARCHITECTURES}")
    tied = (arch == "qwen2") if tie_word_embeddings is None else tie_word_embeddings
    common: dict[str, Any] = dict(
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_heads,
        num_key_value_heads=max(1, size.num_heads // 2),
        head_dim=64,
        vocab_size=size.vocab_size,
        max_position_embeddings=2048,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="float32",
    )
    config = LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)
    if architecture_name is not None:
        config.architectures = [architecture_name]
    return config


def build_tiny_model(
    path: str | Path,
    arch: str = "llama",
    size: str | ModelSize = "1m",
    seed: int = 0,
    tie_word_embeddings: bool | None = None,
    architecture_name: str | None = None,
) -> Path:
    """Write a seeded tiny model directory at ``path`` and return it.

    The weights come from ``transformers``' own initialisation under ``torch.manual_seed(seed)``
    and are saved with ``save_pretrained`` so the tensor names are exactly the Hugging Face ones
    a trainer would write.
    """
    shape = SIZES[size] if isinstance(size, str) else size
    config = hf_config(arch, shape, tie_word_embeddings, architecture_name)
    path = _save_seeded(config, Path(path), seed, torch.float32, shape.vocab_size)
    if architecture_name is not None:
        cfg = json.loads((path / "config.json").read_text())
        cfg["architectures"] = [architecture_name]
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def _save_seeded(config: Any, path: Path, seed: int, dtype: torch.dtype, vocab: int) -> Path:
    """A model of ``config`` initialised under ``seed``, saved with a tokenizer at ``path``."""
    from transformers import AutoModelForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        # transformers initialises with std 0.02; a wider spread makes the tiny model's greedy
        # choices depend on every weight, which makes parity checks sharper.
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    _write_tokenizer(path, vocab)
    return path


def perturb_checkpoint(
    src: str | Path, dst: str | Path, scale: float = 0.05, seed: int = 1
) -> Path:
    """Copy a model directory and add seeded noise to every floating tensor: the "next policy".

    The noise is relative (``scale`` times each tensor's std) so every layer changes visibly.
    """
    src, dst = Path(src), Path(dst)
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    gen = torch.Generator().manual_seed(seed)
    for file in sorted(dst.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            metadata = f.metadata()
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        for name, t in tensors.items():
            if t.is_floating_point():
                noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
                std = float(t.float().std()) if t.numel() > 1 else 1.0
                tensors[name] = (t.float() + noise * scale * max(std, 1e-3)).to(t.dtype)
        save_file(tensors, str(file), metadata=metadata)
    return dst


# -- the architecture matrix -----------------------------------------------------------------
# Tiny random models of the families vLLM's CPU backend serves natively, built from
# ``transformers``' own config classes: what a direct push is proven against (a cold start).
# head_dim 64 everywhere (vLLM's CPU attention takes 32/64/128); DeepSeek-V2 keeps the MLA
# shapes vLLM's CPU MLA requires (kv_lora_rank 512, rope 64).

_DENSE: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    vocab_size=512,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
_MOE: dict[str, Any] = dict(_DENSE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)

MATRIX: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (transformers model_type, config overrides)
    "llama": ("llama", dict(_DENSE, tie_word_embeddings=False)),
    "qwen3-tied": ("qwen3", dict(_DENSE, tie_word_embeddings=True)),
    "mistral": ("mistral", dict(_DENSE, tie_word_embeddings=False)),
    "gemma2": ("gemma2", dict(_DENSE, tie_word_embeddings=True, query_pre_attn_scalar=64)),
    "phi3": ("phi3", dict(_DENSE, tie_word_embeddings=False, num_key_value_heads=2)),
    "qwen3-moe": ("qwen3_moe", dict(_MOE, decoder_sparse_step=1, tie_word_embeddings=False)),
    "qwen2-moe": (
        "qwen2_moe",
        dict(_MOE, shared_expert_intermediate_size=64, tie_word_embeddings=False),
    ),
    "mixtral": (
        "mixtral",
        {
            **{k: v for k, v in _MOE.items() if k not in ("num_experts", "moe_intermediate_size")},
            "num_local_experts": 4,
            "tie_word_embeddings": False,
        },
    ),
    "olmoe": ("olmoe", dict(_MOE, intermediate_size=64, tie_word_embeddings=False)),
    "deepseek-v2": (
        "deepseek_v2",
        dict(
            {k: v for k, v in _MOE.items() if k not in ("num_experts", "head_dim")},
            hidden_size=256,
            num_attention_heads=2,
            num_key_value_heads=2,
            n_routed_experts=4,
            n_shared_experts=1,
            first_k_dense_replace=1,
            q_lora_rank=None,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=64,
            v_head_dim=64,
            topk_method="greedy",
            n_group=1,
            topk_group=1,
            tie_word_embeddings=False,
        ),
    ),
}
MOE_FAMILIES = ("qwen3-moe", "qwen2-moe", "mixtral", "olmoe", "deepseek-v2")


def build_matrix_model(path: str | Path, family: str, seed: int = 0) -> Path:
    """Write a seeded tiny model of one family of :data:`MATRIX` at ``path``."""
    from transformers import AutoConfig

    if family not in MATRIX:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(MATRIX)}")
    model_type, overrides = MATRIX[family]
    config = AutoConfig.for_model(model_type, **overrides)
    return _save_seeded(config, Path(path), seed, torch.float32, int(overrides["vocab_size"]))
