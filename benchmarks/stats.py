"""Statistics of repeated samples, round-robin runs, ratios and output comparisons."""

from __future__ import annotations

import statistics
import traceback
from collections.abc import Callable, Iterable
from typing import Any

from weight_bridge.testing.parity import check_parity

from .config import LOGPROB_TOL


def stats(samples: Iterable[float]) -> dict[str, Any]:
    """Median, min, max and quartiles of ``samples`` (kept too)."""
    xs = [float(x) for x in samples]
    if not xs:
        return {"n": 0, "median": None, "min": None, "max": None, "q1": None, "q3": None}
    s = sorted(xs)
    if len(s) >= 2:
        q1, _, q3 = statistics.quantiles(s, n=4, method="inclusive")
    else:
        q1 = q3 = s[0]
    return {
        "n": len(s),
        "median": statistics.median(s),
        "min": s[0],
        "max": s[-1],
        "q1": q1,
        "q3": q3,
        "samples": xs,
    }


def median(d: dict | None) -> float | None:
    return None if not d else d.get("median")


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


class Rounds:
    """Run named measurements round-robin for ``reps`` rounds; keep each one's samples."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}
        self.extra: dict[str, dict[str, list[float]]] = {}
        self.errors: dict[str, str] = {}

    def run(self, methods: dict[str, Callable[[int], Any]], reps: int) -> None:
        names = list(methods)
        for rep in range(reps):
            k = rep % len(names)
            for name in names[k:] + names[:k]:  # rotate the order: no method always goes first
                if name in self.errors:
                    continue
                try:
                    out = methods[name](rep)
                except Exception as exc:
                    self.errors[name] = f"{type(exc).__name__}: {exc}"
                    traceback.print_exc()
                    continue
                if isinstance(out, dict):
                    for key, value in out.items():
                        self.extra.setdefault(name, {}).setdefault(key, []).append(value)
                    out = out["elapsed_s"]
                self.samples.setdefault(name, []).append(out)

    def result(self, name: str) -> dict[str, Any]:
        if name in self.errors:
            return {"error": self.errors[name], **stats(self.samples.get(name, []))}
        out = stats(self.samples.get(name, []))
        for key, values in self.extra.get(name, {}).items():
            if key != "elapsed_s":
                out[key] = stats(values)
        return out


def compare(got: list | None, want: list | None) -> dict[str, Any]:
    """Same tokens, same top-3 ids, logprobs within ``LOGPROB_TOL`` (float32 reduction noise)."""
    if got is None or want is None:
        return {"match": False, "why": "no output"}
    p = check_parity(got, want, LOGPROB_TOL)
    return {
        "match": p.match,
        "tokens_equal": p.tokens_equal,
        "max_logprob_diff": p.max_logprob_diff,
    }
