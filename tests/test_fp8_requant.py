"""The load-time proof of an online FP8 linear, without an engine: a push may write a layer only
if quantizing the float weight it was loaded with again, on a scratch module, gives exactly the
bytes and scale the layer holds (else its pushes would not be what a cold start computes).

A stand-in for vLLM's method quantizes per channel and registers new parameters as 0.32's
``replace_parameter`` does (losing the loader's ``output_dim``/``input_dim``). A deterministic
method is proven and its layer keeps what its loader needs; one whose result changes from call
to call (a kernel the bridge cannot reproduce) is not; and the scratch run leaves the live
layer untouched.
"""

from __future__ import annotations

import pytest
import torch

from weight_bridge.vllm.worker import fp8_requant


class Method:
    """Per-channel FP8 quantization of ``layer.weight`` (N, K) into (K, N) bytes and an (N, 1)
    scale; ``drift`` changes the scale at every call (a result no second run reproduces)."""

    def __init__(self, drift: float = 0.0):
        self.drift, self.calls = drift, 0

    def process(self, layer: torch.nn.Module) -> None:
        self.calls += 1
        w = layer.get_parameter("weight").detach()
        scale = w.abs().amax(-1, keepdim=True).float() / 448 * (1 + self.drift * self.calls)
        q = (w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        layer.weight = torch.nn.Parameter(q.t(), requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)


def _layer(method: Method) -> torch.nn.Module:
    layer = torch.nn.Module()
    weight = torch.randn(6, 4, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    layer.weight.output_dim, layer.weight.input_dim = 0, 1  # type: ignore[union-attr]
    layer.weight_scale = torch.nn.Parameter(torch.zeros(6, 1), requires_grad=False)
    layer.tp_size, layer.quant_method = 1, method
    return layer


@pytest.fixture(autouse=True)
def bridged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp8_requant, "bridge_options", object)


def _load(method: Method) -> tuple[torch.nn.Module, fp8_requant.Fp8Layer]:
    layer = _layer(method)
    fp8_requant.process_online_fp8(lambda self, layer: self.process(layer))(method, layer)
    return layer, fp8_requant._layers[layer]


def test_a_reproducible_method_is_proven_and_keeps_its_loader_dims() -> None:
    layer, record = _load(Method())
    assert record.unproven is None and record.dtype == torch.bfloat16
    weight = layer.get_parameter("weight")
    assert weight.dtype == torch.float8_e4m3fn and weight.shape == (4, 6)
    assert (weight.output_dim, weight.input_dim) == (0, 1)  # type: ignore[attr-defined]


def test_a_method_the_scratch_run_does_not_reproduce_is_unproven() -> None:
    layer, record = _load(Method(drift=1e-3))
    assert record.unproven is not None and "does not give its bytes and scale" in record.unproven
    weight, scale = layer.get_parameter("weight"), layer.get_parameter("weight_scale")
    before = (weight.detach().view(torch.uint8).clone(), scale.detach().clone())
    fp8_requant.quantize(record.process, layer, torch.ones(6, 4, dtype=torch.bfloat16))
    assert layer.get_parameter("weight") is weight and torch.equal(
        weight.view(torch.uint8), before[0]
    )
    assert torch.equal(layer.get_parameter("weight_scale"), before[1])
