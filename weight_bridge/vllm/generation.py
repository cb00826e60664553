"""One result type for generation, the same from every client (in process, async, over HTTP).

``generate(prompts, sampling)`` on any client returns one :class:`Generation` per prompt: its
:class:`Completion`\\s (tokens, each sampled token's logprob, the top-k per step, which weights
sampled each token), the prompt's logprobs when asked, and the ``policy_version``. The builders
read a vLLM ``RequestOutput`` (:meth:`Generation.from_request_output`, duck-typed), the JSON of
vLLM's token-in/token-out route ``POST /inference/v1/generate`` (:meth:`Generation.from_json`) or
that of ``POST /v1/completions`` asked for token ids and weight versions (vLLM 0.33+,
:meth:`Generation.from_completion_json`).

Version labels are the engine's strings (what a push was labelled: ``"12"``, ``"step-12"``).
The one rule: vLLM's label ``"default"``, the weights the engine started with, becomes ``None``
(:func:`policy_label`); a recipe that counts policy versions in steps reads ``None`` as step 0.

Top-k logprobs follow vLLM's server: the sampled token first, then the most likely others,
``max(k, 1)`` in all (in process vLLM adds the sampled token to the top k; the builder keeps the
first ``max(k, 1)`` so that every client returns the same).

This module imports no vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import UNDEFINED, EngineUndefinedError

DEFAULT_LABEL = "default"  # vLLM's label of the weights an engine started with
_MISSING = -9999.0  # vLLM's server's logprob of a sampled token the engine gave none for


def policy_label(label: Any) -> str | None:
    """The one version rule: an engine's label as a string, ``"default"`` (and None) -> None."""
    if label is None or str(label) == DEFAULT_LABEL:
        return None
    return str(label)


@dataclass(frozen=True)
class VersionSpan:
    """Output tokens ``[start, end)`` were sampled by the weights labelled ``version``."""

    start: int
    end: int
    version: str | None


@dataclass(frozen=True)
class Completion:
    """One sampled completion.

    ``logprobs``: each sampled token's logprob (None unless ``logprobs`` was asked);
    ``top_logprobs``: per step, token id -> logprob of the top ``max(k, 1)`` (the sampled token
    first) when ``logprobs=k`` was asked; ``spans``: which weights sampled which tokens.
    """

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    spans: list[VersionSpan] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def versions(self) -> list[str | None]:
        """The version that sampled each token."""
        out: list[str | None] = []
        for span in self.spans:
            out += [span.version] * (span.end - span.start)
        return out

    @property
    def policy_version(self) -> str | None:
        """The version that sampled the last token (None: the engine's initial weights)."""
        return self.spans[-1].version if self.spans else None


@dataclass(frozen=True)
class Generation:
    """What one prompt gave: its completions (``n`` of them), the logprob of each prompt token
    (None for the first; the list is None unless ``prompt_logprobs`` was asked), how many prompt
    tokens came from the prefix cache (None where the client cannot tell), and the version that
    sampled the last token of its longest completion (:attr:`Completion.policy_version`)."""

    prompt_token_ids: list[int]
    completions: list[Completion]
    prompt_logprobs: list[float | None] | None = None
    num_cached_tokens: int | None = None
    policy_version: str | None = None

    @classmethod
    def from_request_output(
        cls, output: Any, top: int | None = None, fallback: Any = None
    ) -> Generation:
        """From a finished vLLM ``RequestOutput``. ``top``: the ``logprobs`` asked (keeps the
        first ``max(top, 1)`` per step; None keeps all); ``fallback``: the label of tokens whose
        output carries no version spans. A request the engine ended because its weights are
        undefined raises :class:`~weight_bridge.vllm.errors.EngineUndefinedError` with why."""
        for c in output.outputs:
            if c.finish_reason == "error" and UNDEFINED in str(c.stop_reason):
                raise EngineUndefinedError(str(c.stop_reason))
        completions = [
            _completion(
                c.token_ids,
                _top_from_output(c.token_ids, c.logprobs, top),
                [(s.start, s.end, s.version) for s in c.weight_versions or ()],
                c.finish_reason,
                fallback,
            )
            for c in output.outputs
        ]
        ids = list(output.prompt_token_ids or ())
        prompt = None
        if output.prompt_logprobs is not None:
            prompt = [
                None if step is None else float(step[t].logprob)
                for t, step in zip(ids, output.prompt_logprobs, strict=False)
            ]
        cached = getattr(output, "num_cached_tokens", None)
        return _generation(ids, completions, prompt, cached, fallback)

    @classmethod
    def from_json(
        cls, body: Mapping[str, Any], prompt: Sequence[int], fallback: Any = None
    ) -> Generation:
        """From the answer of ``POST /inference/v1/generate`` (``output_mode="tokens"``) to
        ``prompt`` (its token ids)."""
        completions = []
        for choice in sorted(body["choices"], key=lambda c: c.get("index", 0)):
            content = (choice.get("logprobs") or {}).get("content")
            top: list[tuple[float | None, dict[int, float]]] | None = None
            if content is not None:
                top = [
                    (
                        float(step["logprob"]),
                        {int(t["token_id"]): float(t["logprob"]) for t in step["top_logprobs"]},
                    )
                    for step in content
                ]
            versions = choice.get("weight_versions") or ()
            spans = [(s["start"], s["end"], s["version"]) for s in versions]
            completions.append(
                _completion(choice["token_ids"], top, spans, choice.get("finish_reason"), fallback)
            )
        ids = list(body.get("prompt_token_ids") or prompt)
        prompt_lp = _prompt_logprobs(ids, body.get("prompt_logprobs"))
        details = (body.get("usage") or {}).get("prompt_tokens_details") or {}
        return _generation(ids, completions, prompt_lp, details.get("cached_tokens"), fallback)

    @classmethod
    def from_completion_json(
        cls, body: Mapping[str, Any], prompt: Sequence[int], top: int | None, fallback: Any = None
    ) -> Generation:
        """From the answer of ``POST /v1/completions`` to one ``prompt`` (its token ids) asked
        with ``return_token_ids``, ``return_tokens_as_token_ids`` and
        ``return_weight_versions``. ``top``: the ``logprobs`` asked; OpenAI's completions give
        ``top + 1`` per step (the sampled token first), the builder keeps ``max(top, 1)`` as
        the other routes give."""
        choices = sorted(body["choices"], key=lambda c: c.get("index", 0))
        keep = None if top is None else max(top, 1)
        completions = []
        for choice in choices:
            logprobs = choice.get("logprobs")
            steps = None
            if logprobs is not None:
                steps = [
                    (lp, {_token_id(t): float(v) for t, v in list((step or {}).items())[:keep]})
                    for lp, step in zip(
                        logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
                    )
                ]
            versions = choice.get("weight_versions") or ()
            spans = [(s["start"], s["end"], s["version"]) for s in versions]
            completions.append(
                _completion(
                    choice["token_ids"], steps, spans, choice.get("finish_reason"), fallback
                )
            )
        first = choices[0] if choices else {}
        ids = list(first.get("prompt_token_ids") or prompt)
        prompt_lp = _prompt_logprobs(ids, first.get("prompt_logprobs"))
        details = (body.get("usage") or {}).get("prompt_tokens_details") or {}
        return _generation(ids, completions, prompt_lp, details.get("cached_tokens"), fallback)


def _token_id(key: str) -> int:
    """A token of OpenAI's completions logprobs, asked with ``return_tokens_as_token_ids``."""
    return int(key.removeprefix("token_id:"))


def _prompt_logprobs(
    ids: Sequence[int], steps: Sequence[Mapping[str, Any] | None] | None
) -> list[float | None] | None:
    """Each prompt token's logprob from a server's JSON (a step per token, keyed by its id)."""
    if steps is None:
        return None
    return [
        None if step is None else float(step[str(t)]["logprob"])
        for t, step in zip(ids, steps, strict=False)
    ]


def _top_from_output(
    token_ids: Sequence[int], steps: Sequence[Mapping[int, Any] | None] | None, top: int | None
) -> list[tuple[float | None, dict[int, float]]] | None:
    if steps is None:
        return None
    keep = None if top is None else max(top, 1)
    out: list[tuple[float | None, dict[int, float]]] = []
    for t, step in zip(token_ids, steps, strict=True):
        step = step or {}
        sampled = step.get(t)
        items = list(step.items())[:keep]
        lp = None if sampled is None else float(sampled.logprob)
        out.append((lp, {int(k): float(v.logprob) for k, v in items}))
    return out


def _completion(
    token_ids: Iterable[int],
    top: list[tuple[float | None, dict[int, float]]] | None,
    spans: list[tuple[int, int, Any]],
    finish_reason: str | None,
    fallback: Any,
) -> Completion:
    tokens = [int(t) for t in token_ids]
    logprobs = tops = None
    if top is not None:
        tops = [d for _, d in top]
        logprobs = [_MISSING if lp is None else lp for lp, _ in top]
    made = [VersionSpan(int(s), int(e), policy_label(v)) for s, e, v in spans]
    if not made and tokens:
        made = [VersionSpan(0, len(tokens), policy_label(fallback))]
    return Completion(tokens, logprobs, tops, made, finish_reason)


def _generation(
    ids: list[int],
    completions: list[Completion],
    prompt_logprobs: list[float | None] | None,
    cached: int | None,
    fallback: Any,
) -> Generation:
    longest = max(completions, key=lambda c: len(c.token_ids), default=None)
    version = longest.policy_version if longest and longest.spans else policy_label(fallback)
    return Generation(ids, completions, prompt_logprobs, cached, version)


def engine_prompt(prompt: Any) -> Any:
    """A prompt as vLLM takes it: token ids -> ``{"prompt_token_ids": [...]}``; a dict or a
    string as given."""
    if isinstance(prompt, (str, Mapping)):
        return prompt
    return {"prompt_token_ids": [int(t) for t in prompt]}


def prompt_token_ids(prompt: Any) -> list[int]:
    """A prompt's token ids (a list of ints, or ``{"prompt_token_ids": [...]}``); a string is
    refused (a client that cannot tokenize)."""
    if isinstance(prompt, str):
        raise TypeError("this client takes prompts as token ids, not text")
    if isinstance(prompt, Mapping):
        return [int(t) for t in prompt["prompt_token_ids"]]
    return [int(t) for t in prompt]
