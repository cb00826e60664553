"""The end-to-end canary: does the engine compute what the trainer computes?

After a push, the trainer's model and the engine score the same small fixed batch of token ids
(the log-probability of each prompt token given the ones before it). The largest absolute
difference is the *logprob gap*. It catches what no check inside the bridge can: derived state
the bridge does not know about, a checkpoint whose names map onto the wrong weights, a dtype
the trainer and the engine do not share. With the same dtype on both sides the gap is float
summation-order noise (about 1e-6 in float32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import WeightBridgeError


class CanaryError(WeightBridgeError, RuntimeError):
    """After a push, the engine's logprobs of the probe batch differ from the trainer's."""


@dataclass(frozen=True)
class CanaryCheck:
    """Check every push end to end: the trainer's model and the engine score a seeded batch of
    token ids valid for the model's vocabulary (:func:`default_probe`: what matters is that
    both sides score the same tokens, not which) and the largest logprob difference must stay
    within ``tolerance``, else the sync fails."""

    tolerance: float = 1e-3

    def __post_init__(self) -> None:
        if self.tolerance <= 0:
            raise ValueError(f"canary_tolerance must be positive, not {self.tolerance}")

    def gap(self, model: torch.nn.Module, engine: Any) -> float:
        """The logprob gap after a push; raises :class:`CanaryError` above the tolerance."""
        if not callable(getattr(engine, "generate", None)):
            raise CanaryError(
                "the canary scores a probe batch with prompt logprobs from the engine's "
                f"generate, which a {type(engine).__name__} does not offer: use a client of the "
                "bridge (any: in process, async or over HTTP) or no canary"
            )
        probe = default_probe(int(getattr(model.config, "vocab_size", 256)))
        gap = logprob_gap(model, engine, probe)
        if gap > self.tolerance:
            raise CanaryError(
                f"after the push the engine's logprobs differ from the trainer's by {gap:.3g} "
                f"(canary_tolerance={self.tolerance:g}): the engine does not compute what the "
                "trainer computes"
            )
        return gap


def default_probe(vocab_size: int, prompts: int = 4, length: int = 16) -> list[list[int]]:
    """A seeded batch of token ids valid for any vocabulary of ``vocab_size``."""
    g = torch.Generator().manual_seed(1234)
    high = max(2, min(vocab_size, 32000))
    return torch.randint(1, high, (prompts, length), generator=g).tolist()


@torch.no_grad()
def trainer_logprobs(model: torch.nn.Module, probe: list[list[int]]) -> list[list[float]]:
    """Per prompt, the log-probability of tokens 1..n-1 under ``model`` (a causal LM)."""
    training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        out = []
        for ids in probe:
            x = torch.tensor([ids], device=device)
            logits = model(input_ids=x).logits[0, :-1].float()
            lp = torch.log_softmax(logits, dim=-1).gather(1, x[0, 1:, None])[:, 0]
            out.append(lp.cpu().tolist())
        return out
    finally:
        model.train(training)


def engine_logprobs(engine: Any, probe: list[list[int]]) -> list[list[float]]:
    """The same, from the engine's prompt logprobs (any client: the sampling is a dict)."""
    sampling = {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
    result = []
    for ids, generation in zip(probe, engine.generate(probe, sampling), strict=True):
        steps = generation.prompt_logprobs[1:]
        if len(steps) != len(ids) - 1 or any(lp is None for lp in steps):
            raise CanaryError(f"the engine gave no prompt logprobs for the probe {ids}")
        result.append([float(lp) for lp in steps])
    return result


def logprob_gap(model: torch.nn.Module, engine: Any, probe: list[list[int]]) -> float:
    """Largest absolute difference between the trainer's and the engine's logprobs."""
    want = trainer_logprobs(model, probe)
    got = engine_logprobs(engine, probe)
    return max(
        abs(a - b)
        for row_a, row_b in zip(want, got, strict=True)
        for a, b in zip(row_a, row_b, strict=True)
    )
