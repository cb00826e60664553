"""Derived state the bridge re-derives after a direct write, one :class:`Refresher` per kind.

Post-load processing on vLLM's CPU backend leaves state that generation computes with but a write
into the weight does not reach. Each kind keeps what a write must target and derives the rest
again, in place (addresses unchanged):

1. ``cpu packed linear``: vLLM packs each linear weight into a oneDNN handle (the layer's
   ``cpu_linear`` closure) and the bridge keeps the weight; a refresh packs again from it. An
   input embedding's handle is packed on its first use instead: vLLM computes with it only for
   logits from the embedding module itself (Gemma 2), which most models never do, so packing it
   eagerly would re-pack at every push a copy nothing reads (``docs/design.md``). Once used, it
   is re-packed at every push like any linear.
2. ``cpu MoE prepack``: the CPU experts kernel pads and prepacks ``w13_weight`` / ``w2_weight``
   (same shape and dtype, other values); the bridge keeps the unpacked tensors as write targets,
   and a refresh runs the kernel's own processing on a scratch copy and copies the result in.

``cpu_linear`` (:class:`~weight_bridge.vllm.options.BridgeOptions`) picks what happens to linear
layers on the CPU backend:

* ``"repack"`` (default): vLLM packs as usual, the weight is kept and re-packed after each write
  (kind 1): generation at vLLM's own speed, each linear held twice;
* ``"torch"``: :func:`torch_linear` computes with the weight itself: nothing to refresh, slower
  generation (``docs/benchmarks.md``);
* ``"stock"``: vLLM's own behaviour; the emptied weights are re-processed by vLLM's layerwise path
  in ``auto`` mode and refused in ``direct`` mode.

Refreshers are created while the engine processes its weights (the wrappers below, installed
through :mod:`~weight_bridge.vllm.internals`, inert unless the engine is bridged) and collected
with :func:`take_refreshers`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from weakref import WeakKeyDictionary

import torch

from ...direct import Refresher
from ..internals.model import is_input_embedding
from ..internals.patches import cpu_linear_of, drop_cpu_linear, set_cpu_linear
from ..options import CPU_LINEAR_MODES, bridge_options

_pending: WeakKeyDictionary[torch.nn.Module, Refresher] = WeakKeyDictionary()


def torch_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``cpu_linear="torch"``: compute with the live weight itself."""
    return torch.nn.functional.linear(x, weight, bias)


class CpuLinearRepack:
    """The oneDNN packed copy of a CPU linear's weight, packed again after a write.

    ``on_first_use``: the layer's handle may never be computed with (an input embedding, see
    the module docstring), so it is packed when generation first calls it; from then on it is
    known to be used and every refresh packs it again at once, as for any linear."""

    kind = "cpu packed linear"
    explains = frozenset({"cpu_linear"})

    def __init__(
        self, dispatch: Callable[[torch.nn.Module, bool], None], on_first_use: bool = False
    ):
        self.sources: dict[str, torch.Tensor] = {}
        self.dispatch = dispatch
        self.used = not on_first_use

    @property
    def concurrent(self) -> bool:
        """Each re-pack touches its own layer only and runs in oneDNN with the GIL released:
        the linears of a push re-pack side by side on spare CPUs (weight_bridge.direct
        .parallel). Swapping in the first-use packer is no work to split: it runs after them,
        on the calling thread, and does not weigh on their split."""
        return self.used

    def refresh(self, module: torch.nn.Module) -> None:
        # The old handle (held only by the layer's ``cpu_linear`` closure) goes first: its
        # packed buffer is freed before the new one is allocated, so the allocator can hand
        # the same memory back and a push holds one packed copy of a linear, not two. The
        # model is undefined until the push ends, so no forward pass sees the gap.
        drop_cpu_linear(module)
        if self.used:
            self.dispatch(module, False)
        else:
            self.pack_on_first_use(module)

    def pack_on_first_use(self, module: torch.nn.Module) -> None:
        """A ``cpu_linear`` that packs the current weight when generation first calls it, then
        computes with the packed handle (which replaces it)."""

        def pack_then_compute(
            x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
        ) -> torch.Tensor:
            self.used = True
            self.dispatch(module, False)
            return cpu_linear_of(module)(x, weight, bias)

        set_cpu_linear(module, pack_then_compute)


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


def dispatch_cpu_linear(original: Callable[[torch.nn.Module, bool], None]) -> Callable:
    """vLLM's ``dispatch_cpu_unquantized_gemm``, as ``cpu_linear`` asks for a bridged engine."""

    def dispatch_cpu_unquantized_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
        options = bridge_options()
        mode = options.cpu_linear if options is not None else "stock"
        weight = getattr(layer, "weight", None)
        plain = isinstance(weight, torch.Tensor) and not weight.is_meta and weight.ndim == 2
        if mode == "stock" or not plain:
            original(layer, remove_weight)
        elif mode == "torch":
            set_cpu_linear(layer, torch_linear)
        elif mode == "repack":
            first_use = is_input_embedding(layer)
            _pending[layer] = refresher = CpuLinearRepack(original, on_first_use=first_use)
            refresher.refresh(layer)  # packs now, or on first use
        else:
            raise ValueError(f"weight-bridge: cpu_linear must be one of {CPU_LINEAR_MODES}")

    return dispatch_cpu_unquantized_gemm


def process_cpu_moe(original: Callable[[Any, torch.nn.Module], None]) -> Callable:
    """The CPU unquantized experts' processing, keeping what their prepack needs to be derived
    again (a bridged engine)."""

    @torch.no_grad()
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if bridge_options() is None:
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

    return process_weights_after_loading
