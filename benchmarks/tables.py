"""The summary tables of a results JSON: the default push against its limit and vLLM's own
reload, each lever on its own, the HTTP overhead, and the FSDP section."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .config import DEFAULT_CPU_LINEAR, GLIBC, OTHER_CPU_LINEAR

__all__ = ["dig", "summary_tables"]

_ENGINES = (("inprocess", "in-process"), ("multiprocess", "multi-process"))


def dig(d: Any, *keys: str) -> Any:
    """``d[k1][k2]...``, or None where a level is missing."""
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def _s(d: Any, digits: int = 4) -> str:
    """``median [min–max]`` of a stats dict, or a bare number of seconds."""
    if isinstance(d, (int, float)):
        return f"{d:.{digits}f}"
    if not isinstance(d, dict) or d.get("median") is None:
        return "error" if isinstance(d, dict) and "error" in d else "n/a"
    return f"{d['median']:.{digits}f} [{d['min']:.{digits}f}–{d['max']:.{digits}f}]"


def _x(value: Any) -> str:
    return "n/a" if value is None else f"{value:.2f}×"


def _ms(value: Any) -> str:
    return "n/a" if value is None else f"{1e3 * value:.1f} ms"


def _verdict(size: dict[str, Any], key: str) -> str:
    target = size.get("targets", {}).get(key)
    if not target or target["met"] is None:
        return ""
    return " ✓" if target["met"] else " ✗"


def _table(sizes: dict[str, Any], rows: list[tuple[str, Callable[[dict, str], str]]]) -> list[str]:
    """A table with one column per (size, engine)."""
    cols = [(n, eng, label) for n in sizes for eng, label in _ENGINES]
    lines = ["| | " + " | ".join(f"{n}, {label}" for n, _, label in cols) + " |"]
    lines.append("|---" * (len(cols) + 1) + "|")
    for title, cell in rows:
        lines.append(f"| {title} | " + " | ".join(cell(sizes[n], eng) for n, eng, _ in cols) + " |")
    return lines


def _headline(sizes: dict[str, Any]) -> list[str]:
    def r(key: str) -> Callable[[dict, str], str]:
        return lambda s, eng: _x(dig(s, "ratios", eng, key)) + _verdict(s, f"{eng}.{key}")

    def t(key: str) -> Callable[[dict, str], str]:
        return lambda s, eng: _s(dig(s, eng, key))

    def mp_only(key: str) -> Callable[[dict, str], str]:
        return lambda s, eng: (
            _x(dig(s, "ratios", "multiprocess_extra", key)) + _verdict(s, f"{eng}.{key}")
            if eng == "multiprocess"
            else "(multi-process)"
        )

    return [
        "## The default push (issue 24) and vLLM's own reload through its API (issue 20)",
        "",
        "Same engine, same run, interleaved round-robin; seconds are median [min–max]. The push "
        "is `ColocatedEngine.push`: vLLM's `start_weight_update` / `update_weights` / "
        "`finish_weight_update` with the `weight_bridge` backend (default "
        f"`cpu_linear={DEFAULT_CPU_LINEAR}`, NaN guard, sampled read-back). vLLM's own reload "
        'through the same API is `llm.collective_rpc("reload_weights", kwargs={"weights_path": '
        'DIR, "is_checkpoint_format": True})` plus the prefix-cache reset a push also does; on '
        "vLLM's own engine (no bridge) it ran round-robin with pushes into a bridged engine.",
        "",
        *_table(
            sizes,
            [
                ("read+copy limit (s)", t("read_copy")),
                ("**push** (s)", t("direct")),
                (
                    "**push / read+copy** (target ≤ 2.5 in-process at 100m)",
                    r("direct_vs_read_copy"),
                ),
                ("vLLM reload via its API, same engine (s)", t("vllm_api_reload")),
                ("vLLM reload via its API / push", r("vllm_api_reload_vs_direct")),
                (
                    "vLLM reload via its API on vLLM's own engine / push",
                    mp_only("stock_api_reload_vs_repack"),
                ),
                ("**faster vLLM layerwise / push** (target ≥ 2)", r("layerwise_vs_direct")),
                (
                    "generation, repack / vLLM's own engine (target ≥ 0.95)",
                    mp_only("gen_repack_vs_stock"),
                ),
            ],
        ),
    ]


def _levers(sizes: dict[str, Any]) -> list[str]:
    def r(key: str, fmt: Callable[[Any], str] = _x) -> Callable[[dict, str], str]:
        return lambda s, eng: fmt(dig(s, "ratios", eng, key))

    def fresh(s: dict, eng: str) -> str:
        value = dig(s, "ratios", "multiprocess_extra", "glibc_engine_push_vs_repack")
        return _x(value) if eng == "multiprocess" else "(multi-process)"

    def hit(s: dict, eng: str) -> str:
        value = dig(s, eng, "levers", "plan_cache_hit")
        return "n/a" if value is None else ("yes" if value else "**no**")

    def fit(s: dict, eng: str) -> str:
        value = dig(s, "ratios", "multiprocess_extra", "fixed_cost_fit", "fixed_s")
        return _ms(value) if eng == "multiprocess" else "(multi-process)"

    return [
        "## Each lever on its own",
        "",
        "Ratios > 1 mean the lever saves time: the push without it / the default push, in the "
        "same rounds. *glibc default, switched*: the worker's allocator switched to glibc's "
        "default parameters (fixed 128 KiB thresholds) for that push; *fresh process*: a second "
        "engine whose processes never changed glibc's defaults (`WEIGHT_BRIDGE_MALLOC=default`), "
        "pushes round-robin with the default engine. *Overlap* (writing linear i+1 while linear "
        "i is re-packed, in a second thread) is not in the push; it is probed inside the worker "
        "on the engine's own linears (> 1 would mean it pays).",
        "",
        *_table(
            sizes,
            [
                ("allocator: push with glibc default, switched / push", r("allocator_effect")),
                ("allocator: push in a fresh glibc-default engine / push", fresh),
                ("plan cache: push with the plan dropped / push", r("plan_cache_effect")),
                ("plan cache hit on a push", hit),
                ("fixed cost: partial push of one small tensor", r("fixed_s", _ms)),
                ("fixed cost: linear fit over the partial pushes", fit),
                ("one address audit inside the worker (3 per push)", r("audit_s", _ms)),
                ("refresh (re-pack) share of the push", r("refresh_share")),
                ("overlap probe: sequential / overlapped write+re-pack", r("overlap_effect")),
            ],
        ),
    ]


def _http(sizes: dict[str, Any]) -> list[str]:
    lines = [
        "## HTTP overhead of a push (a `vllm serve` process beside the multi-process engine)",
        "",
        "| size | push over HTTP (s) | same push, multi-process engine (s) | HTTP / engine "
        "| overhead | tiny push over HTTP | tiny push, engine | tiny overhead | server start-up |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n, s in sizes.items():
        h = dig(s, "multiprocess", "http") or {}
        r = dig(s, "ratios", "multiprocess_extra") or {}
        if not h:
            continue
        if "error" in h:
            lines.append(f"| {n} | error: {h['error'][:200]} |")
            continue
        lines.append(
            f"| {n} | {_s(h.get('http'))} | {_s(h.get('engine'))} | {_x(r.get('http_vs_engine'))} "
            f"| {_ms(r.get('http_overhead_s'))} | {_s(h.get('http_tiny'))} "
            f"| {_s(h.get('engine_tiny'))} | {_ms(r.get('http_tiny_overhead_s'))} "
            f"| {h.get('startup_s', 0):.1f} s |"
        )
    return lines


def _generation(sizes: dict[str, Any], st: dict[str, Any]) -> list[str]:
    modes = (DEFAULT_CPU_LINEAR, GLIBC, OTHER_CPU_LINEAR, "stock")
    lines = [
        "## Generation speed (tokens/s)",
        "",
        f"Greedy batch of {st.get('gen_batch')} prompts × {st.get('gen_tokens')} tokens (prefill "
        "included), multi-process engines alive together, measured round-robin, "
        f"{st.get('gen_reps')} reps each. `stock` is vLLM's own engine without the bridge.",
        "",
        "| size | " + " | ".join(modes) + " | repack / stock | repack / torch |",
        "|---" * (len(modes) + 3) + "|",
    ]
    for n, s in sizes.items():
        gen = dig(s, "multiprocess", "generation")
        if not gen:
            continue
        r = dig(s, "ratios", "multiprocess_extra") or {}
        cells = [_s(dig(gen, m, "tokens_per_s"), 1) for m in modes]
        lines.append(
            f"| {n} | " + " | ".join(cells) + f" | {_x(r.get('gen_repack_vs_stock'))}"
            f" | {_x(r.get(f'gen_repack_vs_{OTHER_CPU_LINEAR}'))} |"
        )
    return lines


def summary_tables(results: dict[str, Any]) -> list[str]:
    """Markdown lines of every summary table (and the FSDP section, if it ran)."""
    sizes = results["sizes"]
    lines = [*_headline(sizes), "", *_levers(sizes), "", *_http(sizes), ""]
    lines += [*_generation(sizes, results.get("settings", {})), ""]
    fsdp = results.get("fsdp")
    if isinstance(fsdp, dict) and "error" not in fsdp and "fsdp" in fsdp:
        from .fsdp import render

        lines += [render(fsdp), ""]
    elif isinstance(fsdp, dict):
        lines += ["## FSDP2 sync vs DDP sync", "", f"error: {fsdp.get('error', '')[-500:]}", ""]
    inflight = results.get("inflight")
    if isinstance(inflight, dict) and "pauses" in inflight:
        from .inflight import render as render_inflight

        lines += ["## In-flight pushes", "", render_inflight(inflight), ""]
    elif isinstance(inflight, dict):
        lines += ["## In-flight pushes", "", f"error: {inflight.get('error', '')[-500:]}", ""]
    return lines
