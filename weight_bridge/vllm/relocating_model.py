"""A stock vLLM architecture whose post-load processing moves weights into other storages.

On GPUs, post-load processing relocates weights all the time (fused MoE buffers, fused GEMM
inputs such as DeepSeek-V4's compressor, padded or realigned weights); on the CPU backend no
stock model does. ``RelocatingLlamaForCausalLM`` is Llama with three such moves, so the
relocation path of a direct reload runs inside a real engine:

1. every layer's ``o_proj.weight`` is ``set_`` into one shared fused buffer, side by side;
2. every ``down_proj.weight`` is copied into a buffer with padded rows (a larger row stride,
   same logical shape), as kernels that want aligned rows do;
3. every ``gate_up_proj.weight`` is re-strided to column-major (same logical shape).

Serve it by writing ``"architectures": ["RelocatingLlamaForCausalLM"]`` into a Llama config
(see :func:`weight_bridge.models.build_tiny_model`'s ``architecture_name``).
"""

from __future__ import annotations

import torch

ARCHITECTURE = "RelocatingLlamaForCausalLM"
ROW_PADDING = 16


def register_relocating_models() -> None:
    """Make the architecture known to vLLM's ``ModelRegistry`` (lazily imported)."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, f"{__name__}:RelocatingLlamaForCausalLM")


def _move(param: torch.Tensor, storage: torch.Tensor, offset: int, stride: tuple[int, ...]) -> None:
    with torch.no_grad():
        param.set_(storage.untyped_storage(), offset, param.shape, stride)


def _movable(w: torch.Tensor) -> bool:
    # With cpu_linear="stock", vLLM has already packed the linears and emptied these weights.
    return w.ndim == 2 and w.numel() > 0


def relocate(model: torch.nn.Module) -> None:
    """Apply the three moves to every decoder layer of ``model`` (in place)."""
    layers = [m for name, m in model.named_modules() if name.endswith("self_attn")]
    weights = [layer.o_proj.weight for layer in layers if _movable(layer.o_proj.weight)]
    if not weights:
        return
    fused = torch.empty(sum(w.numel() for w in weights), dtype=weights[0].dtype)
    offset = 0
    for w in weights:
        n = w.numel()
        fused[offset : offset + n].copy_(w.detach().reshape(-1))
        _move(w, fused, offset, tuple(w.stride()))
        offset += n
    for name, module in model.named_modules():
        if name.endswith("mlp") and _movable(module.down_proj.weight):
            down = module.down_proj.weight
            rows, cols = down.shape
            padded = torch.zeros(rows, cols + ROW_PADDING, dtype=down.dtype)
            padded[:, :cols].copy_(down.detach())
            _move(down, padded, 0, (cols + ROW_PADDING, 1))
            gate_up = module.gate_up_proj.weight
            column_major = gate_up.detach().t().contiguous()
            _move(gate_up, column_major, 0, (1, gate_up.shape[0]))


def _build_class():
    from vllm.model_executor.models.llama import LlamaForCausalLM

    class RelocatingLlamaForCausalLM(LlamaForCausalLM):
        def process_weights_after_loading(self) -> None:
            relocate(self)

    return RelocatingLlamaForCausalLM


def __getattr__(name: str):
    # vLLM imports the class by name; building it lazily keeps this module importable
    # without initialising vLLM's model code.
    if name == ARCHITECTURE:
        cls = _build_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
