"""Output parity: greedy tokens and top-k logprobs of an engine, and how two of them differ.

What tests, benchmarks, the soak and the GPU check judge "the engine serves these weights" on:
the same fixed token-id prompts, greedy decoding, the top-k log-probabilities of every step.
Two outputs match when the tokens are the same, every step's top-k ids are the same, and the
log-probabilities agree within ``tol`` (float32 summation-order noise: a warm and a cold engine
may batch, and so reduce, differently; 1e-4 is far below any weight change a push makes).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from weight_bridge.vllm.clients.bridge_client import BridgeClient
from weight_bridge.vllm.generation import Generation

PROMPTS: list[list[int]] = [
    [1, 20, 21, 22],
    [1, 5, 9, 30, 31],
    [1, 100, 101],
    [1, 7, 7, 7, 7, 7, 7, 8],
]
LOGPROB_TOL = 1e-4


def collect(generations: Iterable[Any]) -> list:
    """``[(tokens, [[(id, logprob), ...] sorted by id, per step]), ...]`` of the first completion
    of each :class:`~weight_bridge.vllm.generation.Generation` (what every client's ``generate``
    returns; a plain vLLM ``RequestOutput`` is read as one)."""
    out = []
    for g in generations:
        if not isinstance(g, Generation):
            g = Generation.from_request_output(g)
        c = g.completions[0]
        out.append((list(c.token_ids), [sorted(step.items()) for step in c.top_logprobs or ()]))
    return out


def greedy(
    engine: Any,
    prompts: Sequence[Sequence[int]] = PROMPTS,
    max_tokens: int = 12,
    logprobs: int = 3,
    **sampling: Any,
) -> list:
    """Greedy tokens and top-k logprobs per prompt (see :func:`collect`), from any client of
    the bridge (or a plain ``vllm.LLM``).

    ``sampling``: more of vLLM's sampling parameters (``ignore_eos=True``, say).
    """
    params = dict(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs, **sampling)
    if isinstance(engine, BridgeClient):
        return collect(engine.generate([list(p) for p in prompts], params))
    from vllm import SamplingParams

    from weight_bridge.vllm.clients.llm import token_prompts

    return collect(engine.generate(token_prompts(prompts), SamplingParams(**params)))


@dataclass(frozen=True)
class Parity:
    """How two outputs of :func:`greedy` compare."""

    problems: list[str]  # empty when they match
    tokens_equal: bool  # same number of prompts, same tokens, same top-k ids at every step
    max_logprob_diff: float  # over the prompts whose tokens are equal

    @property
    def match(self) -> bool:
        return not self.problems


def check_parity(got: Sequence, want: Sequence, tol: float | None = LOGPROB_TOL) -> Parity:
    """Compare ``got`` with ``want``; ``tol=None`` compares tokens and top-k ids only."""
    problems: list[str] = []
    tokens_equal = len(got) == len(want)
    worst = 0.0
    if not tokens_equal:
        problems.append(f"{len(got)} outputs, expected {len(want)}")
    for i, ((gt, glp), (wt, wlp)) in enumerate(zip(got, want, strict=False)):
        if list(gt) != list(wt):
            tokens_equal = False
            problems.append(f"prompt {i}: tokens {list(gt)}, expected {list(wt)}")
            continue
        if len(glp) != len(wlp):
            problems.append(f"prompt {i}: logprobs of {len(glp)} steps, expected {len(wlp)}")
        for step, (g_step, w_step) in enumerate(zip(glp, wlp, strict=False)):
            g_ids, w_ids = [k for k, _ in g_step], [k for k, _ in w_step]
            if g_ids != w_ids:
                tokens_equal = False
                problems.append(f"prompt {i} step {step}: top-k ids {g_ids}, expected {w_ids}")
            for (k, g), (_, w) in zip(g_step, w_step, strict=False):
                worst = max(worst, abs(g - w))
                if tol is not None and g_ids == w_ids and not abs(g - w) <= tol:
                    problems.append(
                        f"prompt {i} step {step} token {k}: logprob {g!r}, expected {w!r} "
                        f"(differs by {abs(g - w):.3g} > {tol})"
                    )
    return Parity(problems, tokens_equal, worst)


def parity_problems(got: Sequence, want: Sequence, tol: float | None = LOGPROB_TOL) -> list[str]:
    """What differs between two outputs of :func:`greedy`; empty if they match.

    Match: same tokens, same top-k ids, logprobs within ``tol`` (``None``: not compared).
    """
    return check_parity(got, want, tol).problems
