"""Derived state the bridge re-derives after a direct write, one :class:`Refresher` per kind.

Post-load processing on vLLM's CPU backend leaves state that generation computes with but a
write into the weight does not reach. Each kind below keeps what a write must target and knows
how to derive the rest again, in place (addresses unchanged):

1. ``cpu packed linear``: ``cpu_linear="repack"`` lets vLLM pack each linear weight into a
   oneDNN handle (held in the layer's ``cpu_linear`` closure) but keeps the weight; a refresh
   packs again from the written weight.
2. ``cpu MoE prepack``: the unquantized CPU experts kernel pads and prepacks ``w13_weight`` /
   ``w2_weight`` into its grouped-GEMM layout (same shape and dtype, other values). The
   bridge keeps the unpacked tensors as the write targets; a refresh runs the kernel's own
   processing on a scratch copy of them and copies the result into the live parameters.

``cpu_linear`` (an option of :class:`~weight_bridge.vllm.options.BridgeOptions`) picks what
happens to linear layers on the CPU backend, which vLLM packs into oneDNN handles and empties:

* ``"repack"`` (default): vLLM packs as usual but the weight is kept; after each direct write
  the packed form is derived again (kind 1 above). Generation runs at vLLM's own speed; memory
  holds each linear twice (weight and packed copy).
* ``"torch"``: the weight is kept and computed with by :func:`torch_linear`; nothing derived to
  refresh, but generation is slower (measured 0.53-0.58x stock by ``make bench``).
* ``"stock"``: vLLM's own behaviour; the emptied weights are re-processed by vLLM's layerwise
  path in ``auto`` mode and refused in ``direct`` mode.

Refreshers are created while the engine processes its weights (the patches below, installed
by :func:`install` and inert unless the engine is bridged) and collected by the plugin with
:func:`take_refreshers`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from weakref import WeakKeyDictionary

import torch

from ..direct import Refresher
from .options import CPU_LINEAR_MODES, BridgeOptions

__all__ = ["CpuLinearRepack", "CpuMoePrepack", "install", "take_refreshers", "torch_linear"]

_pending: WeakKeyDictionary[torch.nn.Module, Refresher] = WeakKeyDictionary()


def torch_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``cpu_linear="torch"``: compute with the live weight itself."""
    return torch.nn.functional.linear(x, weight, bias)


class CpuLinearRepack:
    """The oneDNN packed copy of a CPU linear's weight, packed again after a write."""

    kind = "cpu packed linear"
    explains = frozenset({"cpu_linear"})

    def __init__(self, dispatch: Callable[[torch.nn.Module, bool], None]):
        self.sources: dict[str, torch.Tensor] = {}
        self.dispatch = dispatch

    def refresh(self, module: torch.nn.Module) -> None:
        # The old handle (held only by the layer's ``cpu_linear`` closure) goes first: its
        # packed buffer is freed before the new one is allocated, so the allocator can hand
        # the same memory back and a push holds one packed copy of a linear, not two. The
        # model is undefined until the push ends, so no forward pass sees the gap.
        module.__dict__.pop("cpu_linear", None)
        self.dispatch(module, False)


class CpuMoePrepack:
    """The CPU experts kernel's prepacked ``w13``/``w2``, derived again from kept sources."""

    kind = "cpu MoE prepack"

    def __init__(self, experts: Any, process: Callable[[Any, torch.nn.Module], None], sources):
        self.explains = frozenset(sources)
        self.sources: dict[str, torch.Tensor] = dict(sources)
        self.experts = experts
        self.process = process

    @torch.no_grad()
    def refresh(self, module: torch.nn.Module) -> None:
        scratch = torch.nn.Module()
        for name, p in module.named_parameters(recurse=False):
            src = self.sources.get(name)
            data = src.clone() if src is not None else p.detach()
            scratch.register_parameter(name, torch.nn.Parameter(data, requires_grad=False))
        self.process(self.experts, scratch)
        for name in self.sources:
            live, fresh = getattr(module, name), getattr(scratch, name)
            if live.shape != fresh.shape or live.dtype != fresh.dtype:
                raise RuntimeError(
                    f"{name}: the kernel's processing now yields {list(fresh.shape)} "
                    f"{fresh.dtype}, the live parameter is {list(live.shape)} {live.dtype}"
                )
            live.copy_(fresh)


def take_refreshers(model: torch.nn.Module) -> dict[str, Refresher]:
    """The refreshers created while ``model`` was processed, by module name."""
    return {name: _pending.pop(m) for name, m in model.named_modules() if m in _pending}


def _patch_cpu_linear(bridged: Callable[[], BridgeOptions | None]) -> None:
    from vllm.model_executor.layers import utils as layer_utils

    original = layer_utils.dispatch_cpu_unquantized_gemm

    def dispatch_cpu_unquantized_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
        options = bridged()
        mode = options.cpu_linear if options is not None else "stock"
        weight = getattr(layer, "weight", None)
        plain = isinstance(weight, torch.Tensor) and not weight.is_meta and weight.ndim == 2
        if mode == "stock" or not plain:
            original(layer, remove_weight)
        elif mode == "torch":
            setattr(layer, "cpu_linear", torch_linear)  # noqa: B010 (nn.Module attribute)
        elif mode == "repack":
            original(layer, False)
            _pending[layer] = CpuLinearRepack(original)
        else:
            raise ValueError(f"weight-bridge: cpu_linear must be one of {CPU_LINEAR_MODES}")

    layer_utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm


def _patch_cpu_moe(bridged: Callable[[], BridgeOptions | None]) -> None:
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    cls = cpu_moe.CPUUnquantizedExperts
    original = cls.process_weights_after_loading

    @torch.no_grad()
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if bridged() is None:
            return original(self, layer)
        before = dict(layer.named_parameters(recurse=False))
        kept = {name: p.detach().clone() for name, p in before.items()}
        original(self, layer)
        sources = {
            name: kept[name]
            for name, p in layer.named_parameters(recurse=False)
            if name in kept and (p is not before[name] or p.data_ptr() != kept[name].data_ptr())
        }
        if sources:
            _pending[layer] = CpuMoePrepack(self, original, sources)

    cls.process_weights_after_loading = process_weights_after_loading  # type: ignore[method-assign]


def install(bridged: Callable[[], BridgeOptions | None]) -> None:
    """Patch the CPU backend's processing so bridged engines register their refreshers."""
    _patch_cpu_linear(bridged)
    _patch_cpu_moe(bridged)
