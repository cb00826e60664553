"""Statistics of repeated samples, round-robin runs, ratios, targets and the correctness verdict."""

from __future__ import annotations

import statistics
import traceback
from collections.abc import Callable, Iterable
from typing import Any

from weight_bridge.testing.parity import check_parity

from .config import (
    DEFAULT_CPU_LINEAR,
    ENGINES,
    LOGPROB_TOL,
    MEM_FIXED_ALLOWANCE,
    OTHER_CPU_LINEAR,
    PARITY_PROMPTS,
    PARITY_TOKENS,
    TARGETS,
)


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


def _target(name: str, value: float | None) -> dict[str, Any]:
    t = TARGETS[name.rsplit(".", 1)[-1]]
    met = None
    if value is not None:
        met = value <= t["value"] if t["op"] == "<=" else value >= t["value"]
    return {"value": value, "target": f"{t['op']} {t['value']}", "met": met, "what": t["what"]}


def engine_ratios(e: dict[str, Any], largest: int) -> dict[str, float | None]:
    """The ratios of one engine's measurements (medians over medians)."""
    if not e or "error" in e and "direct" not in e:
        return {}
    direct = median(e.get("direct"))
    read_copy = median(e.get("read_copy"))
    lw_file, lw_iter = median(e.get("layerwise_file")), median(e.get("layerwise_iter"))
    lw_best = min((x for x in (lw_file, lw_iter) if x is not None), default=None)
    mem = e.get("memory", {}).get("direct", {})
    peak = mem.get("peak_extra_anon")
    return {
        "direct_vs_read_copy": ratio(direct, read_copy),
        "direct_no_finite_vs_read_copy": ratio(median(e.get("direct_no_finite")), read_copy),
        "direct_vs_copy": ratio(direct, median(e.get("copy"))),
        "read_copy_vs_copy": ratio(read_copy, median(e.get("copy"))),
        "finite_guard_cost": ratio(direct, median(e.get("direct_no_finite"))),
        "verify_hash_cost": ratio(median(e.get("direct_verify_hash")), direct),
        "readback_cost": ratio(direct, median(e.get("direct_readback_off"))),
        "readback_full_cost": ratio(
            median(e.get("direct_readback_full")), median(e.get("direct_readback_off"))
        ),
        "rollback_vs_direct": ratio(median(e.get("rollback")), direct),
        "layerwise_vs_direct": ratio(lw_best, direct),
        "layerwise_file_vs_direct": ratio(lw_file, direct),
        "layerwise_iter_vs_direct": ratio(lw_iter, direct),
        "naive_vs_direct": ratio(median(e.get("naive_loop")), direct),
        "cold_vs_direct": ratio(median(e.get("cold_restart")), direct),
        "startup_vs_direct": ratio(e.get("startup_s"), direct),
        "peak_anon_vs_largest": (
            None if peak is None else max(0, peak - MEM_FIXED_ALLOWANCE) / largest
        ),
        "peak_anon_raw_vs_largest": None if peak is None else peak / largest,
    }


def analyse(size: dict[str, Any]) -> None:
    """Ratios, targets and correctness of one size's raw results (in place)."""
    largest = size["model"]["largest_tensor_bytes"]
    save = size.get("save", {})
    ratios: dict[str, Any] = {eng: engine_ratios(size.get(eng, {}), largest) for eng in ENGINES}
    for where in ("disk", "shm"):
        ratios[f"save_vs_raw_{where}"] = ratio(
            median(save.get(where, {}).get("save_checkpoint")),
            median(save.get(where, {}).get("raw_write")),
        )
    gen = size.get("multiprocess", {}).get("generation", {})
    base = median(gen.get(DEFAULT_CPU_LINEAR, {}).get("tokens_per_s"))
    for mode in (OTHER_CPU_LINEAR, "stock"):
        ratios[f"gen_{DEFAULT_CPU_LINEAR}_vs_{mode}"] = ratio(
            base, median(gen.get(mode, {}).get("tokens_per_s"))
        )
    size["ratios"] = ratios
    targets: dict[str, Any] = {}
    for eng in ENGINES:
        for name in (
            "direct_vs_read_copy",
            "layerwise_vs_direct",
            "peak_anon_vs_largest",
            "readback_cost",
        ):
            targets[f"{eng}.{name}"] = _target(name, ratios[eng].get(name))
    targets["inprocess.cold_vs_direct"] = _target(
        "cold_vs_direct", ratios["inprocess"].get("cold_vs_direct")
    )
    for where in ("disk", "shm"):
        targets[f"save_vs_raw_{where}"] = _target(
            f"save_vs_raw_{where}", ratios[f"save_vs_raw_{where}"]
        )
    size["targets"] = targets

    ip, mp = size.get("inprocess", {}), size.get("multiprocess", {})
    cold = ip.get("outputs", {}).get("cold_B")
    checks: dict[str, Any] = {}
    for eng, e in (("inprocess", ip), ("multiprocess", mp)):
        outs = e.get("outputs", {})
        for path in ("direct", "layerwise_iter", "layerwise_file", "naive_loop"):
            checks[f"{path}_{eng}"] = compare(outs.get(path), cold)
    if f"engine_{OTHER_CPU_LINEAR}" in mp:
        checks[f"direct_{OTHER_CPU_LINEAR}_multiprocess"] = mp[f"engine_{OTHER_CPU_LINEAR}"].get(
            "parity_vs_own_cold", {"match": False}
        )
    if "partial" in mp:
        checks["partial_chain_multiprocess"] = mp["partial"].get("parity_vs_cold", {"match": False})
    a_out = ip.get("outputs", {}).get("A")
    discriminates = a_out is not None and cold is not None and a_out != cold
    required = ["direct_inprocess", "direct_multiprocess"]
    if "partial" in mp:
        required.append("partial_chain_multiprocess")
    size["correctness"] = {
        "reference": "greedy output of a cold in-process start on B (same engine settings)",
        "prompts": PARITY_PROMPTS,
        "max_tokens": PARITY_TOKENS,
        "logprob_tolerance": LOGPROB_TOL,
        "prompts_discriminate_A_from_B": discriminates,
        "checks": checks,
        "required": list(required),
        "passed": bool(discriminates and all(checks[k]["match"] for k in required)),
    }
