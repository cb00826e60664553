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
(see :func:`weight_bridge.testing.models.build_tiny_model`'s ``architecture_name``).
"""

from __future__ import annotations

import torch

ARCHITECTURE = "RelocatingLlamaForCausalLM"
PROCESSING_ARCHITECTURE = "ProcessingLlamaForCausalLM"
TRANSFORMED_MODULE = "model.layers.0.self_attn.qkv_proj"
DERIVED_MODULE = "model.layers.1.self_attn.qkv_proj"
ROW_PADDING = 16


def register() -> None:
    """Make the architecture known to vLLM's ``ModelRegistry`` (lazily imported)."""
    from vllm import ModelRegistry

    for arch in (ARCHITECTURE, PROCESSING_ARCHITECTURE):
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, f"{__name__}:{arch}")


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


def _build_classes() -> dict[str, type]:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.models.llama import LlamaForCausalLM

    class RelocatingLlamaForCausalLM(LlamaForCausalLM):
        def process_weights_after_loading(self) -> None:
            relocate(self)

    class ScaledLinearMethod(UnquantizedLinearMethod):
        """Value-changing processing: the weight is stored doubled, the forward halves it."""

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            with torch.no_grad():
                layer.get_parameter("weight").mul_(2.0)

        def apply(self, layer, x, bias=None):
            return torch.nn.functional.linear(x, layer.weight * 0.5, bias)

    class TransposedCopyLinearMethod(UnquantizedLinearMethod):
        """State-deriving processing: the forward reads a transposed copy of the weight."""

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            weight = layer.get_parameter("weight")
            layer.register_buffer("weight_t", weight.detach().t().contiguous())

        def apply(self, layer, x, bias=None):
            out = x @ layer.weight_t
            return out if bias is None else out + bias

    class ProcessingLlamaForCausalLM(RelocatingLlamaForCausalLM):
        """The relocating model, plus one module whose processing changes its weight's values
        (:data:`TRANSFORMED_MODULE`) and one that derives a copy from it
        (:data:`DERIVED_MODULE`): both done by the module's own quantization method, which
        vLLM's layerwise path re-runs."""

        def __init__(self, *, vllm_config, prefix: str = ""):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            setattr(self.get_submodule(TRANSFORMED_MODULE), "quant_method", ScaledLinearMethod())  # noqa: B010
            setattr(  # noqa: B010 (a plain attribute of an nn.Module)
                self.get_submodule(DERIVED_MODULE), "quant_method", TransposedCopyLinearMethod()
            )

    return {
        ARCHITECTURE: RelocatingLlamaForCausalLM,
        PROCESSING_ARCHITECTURE: ProcessingLlamaForCausalLM,
    }


def __getattr__(name: str):
    # vLLM imports the classes by name; building them lazily keeps this module importable
    # without initialising vLLM's model code.
    if name in (ARCHITECTURE, PROCESSING_ARCHITECTURE):
        globals().update(_build_classes())
        return globals()[name]
    raise AttributeError(name)
