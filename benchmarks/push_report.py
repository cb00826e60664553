"""The "push" section's analysis (ratios of medians from the same rounds, targets, the
correctness verdict) and its report: ``bench/results.json``'s markdown and figure."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from . import harness
from .harness import dig, fmt, line, mark, median, ratio, spread, table, verdict
from .inflight import render as render_inflight
from .push import DEFAULT_CPU_LINEAR, GLIBC, OTHER_CPU_LINEAR, model_source
from .sync import render_fsdp

# fmt: off
ENGINES = ("inprocess", "multiprocess")
MEM_FIXED_ALLOWANCE = 32 * 2**20  # the "small fixed overhead" of the peak-memory target
TARGETS = {name: {"op": op, "value": value, "what": what} for name, op, value, what in (
    ("direct_vs_read_copy", "<=", 2.5,
     "push (default: cpu_linear=repack, guards, sampled read-back) / read+copy limit"),
    ("layerwise_vs_direct", ">=", 2.0, "faster of vLLM's layerwise reloads / push"),
    ("gen_repack_vs_stock", ">=", 0.95,
     "generation tokens/s, the bridge's default (repack) / vLLM's own engine"),
    ("cold_vs_direct", ">=", 100.0, "cold restart (engine start only) / in-process push"),
    ("readback_cost", "<=", 1.1,
     "push with the sampled read-back (default) / push with readback=off"),
    ("save_vs_raw_disk", "<=", 1.5,
     "save_checkpoint / raw write of the same bytes, disk, both fsynced"),
    ("save_vs_raw_shm", "<=", 1.5,
     "save_checkpoint / raw write of the same bytes, /dev/shm, both fsynced"),
    ("peak_anon_vs_largest", "<=", 1.2,
     "(peak extra RssAnon during an in-process push - 32 MiB) / largest tensor"))}
ONLY = {"direct_vs_read_copy": {("inprocess", "100m")}}  # where a target is set; else a ratio
TIME_ROWS = [
    ("copy_ limit", "copy"), ("read+copy limit (mmap, page cache)", "read_copy"),
    ("**push** (default guards)", "direct"), ("push, check_finite=False", "direct_no_finite"),
    ("push, verify_hash=True", "direct_verify_hash"), ("push, readback=off", "direct_readback_off"),
    ("push, readback=full", "direct_readback_full"),
    ("rollback after a failed push (the previous version re-written)", "rollback"),
    ("vLLM reload_weights through its API (collective_rpc, weights_path)", "vllm_api_reload"),
    ("vLLM layerwise reload_weights(weights_path=dir)", "layerwise_file"),
    ("vLLM layerwise reload_weights(weights_iterator=file)", "layerwise_iter"),
    ("naive per-tensor model.load_weights loop", "naive_loop")]
RATIO_ROWS = [
    ("push / read+copy (target ≤ 2.5 in-process, 100m)", "direct_vs_read_copy"),
    ("push without NaN check / read+copy", "direct_no_finite_vs_read_copy"),
    ("NaN-check cost (push / push without)", "finite_guard_cost"),
    ("hash cost (push+verify / push)", "verify_hash_cost"),
    ("read-back cost (push / push readback=off, target ≤ 1.1)", "readback_cost"),
    ("full read-back cost (readback=full / off)", "readback_full_cost"),
    ("rollback / push", "rollback_vs_direct"),
    ("faster layerwise / push (target ≥ 2)", "layerwise_vs_direct"),
    ("vLLM reload via its API / push", "vllm_api_reload_vs_direct"),
    ("naive loop / push", "naive_vs_direct"),
    ("(peak extra anon − 32 MiB) / largest tensor (target ≤ 1.2)", "peak_anon_vs_largest")]
SAVE_ROWS = [("save_checkpoint, disk", "disk", "save_checkpoint"),
             ("raw write + fsync, disk", "disk", "raw_write"),
             ("save_checkpoint, /dev/shm", "shm", "save_checkpoint"),
             ("raw write + fsync, /dev/shm", "shm", "raw_write"),
             ("blake3 of the bytes only", "disk", "hash_only")]
LEGACY_CHECKS = {  # checks of older results files that could not fail, and what replaced them
    "stock_own_reload_multiprocess": (
        "this run's vLLM engine started on B and was reloaded with B, which cannot differ "
        "from a cold start on B; replaced by stock_own_reload_a_to_b_multiprocess (started "
        "on A, reloaded with B), to be measured by the next `make bench`")}
MIB = partial(fmt, spec=".1f", unit="", scale=2**-20)
MS = partial(fmt, spec=".1f", unit=" ms", scale=1e3)

PAIRS = {  # ratio: (numerator, denominator), medians of the same engine's rounds
    "direct_vs_read_copy": ("direct", "read_copy"), "read_copy_vs_copy": ("read_copy", "copy"),
    "direct_no_finite_vs_read_copy": ("direct_no_finite", "read_copy"),
    "direct_vs_copy": ("direct", "copy"), "finite_guard_cost": ("direct", "direct_no_finite"),
    "verify_hash_cost": ("direct_verify_hash", "direct"),
    "readback_cost": ("direct", "direct_readback_off"),
    "readback_full_cost": ("direct_readback_full", "direct_readback_off"),
    "rollback_vs_direct": ("rollback", "direct"),
    "vllm_api_reload_vs_direct": ("vllm_api_reload", "direct"),
    "layerwise_vs_direct": ("layerwise", "direct"),
    "layerwise_file_vs_direct": ("layerwise_file", "direct"),
    "layerwise_iter_vs_direct": ("layerwise_iter", "direct"),
    "naive_vs_direct": ("naive_loop", "direct"), "cold_vs_direct": ("cold_restart", "direct"),
    "startup_vs_direct": ("startup_s", "direct")}

def engine_ratios(e: dict[str, Any], largest: int) -> dict[str, float | None]:
    """One engine's ratios; each lever against the default push of the same rounds."""
    if not e or "error" in e and "direct" not in e:
        return {}
    m, lv = ({k: median(v) for k, v in d.items()} for d in (e, e.get("levers", {})))
    lw = [x for x in (m.get("layerwise_file"), m.get("layerwise_iter")) if x is not None]
    m.update(layerwise=min(lw, default=None), startup_s=e.get("startup_s"))
    peak = dig(e, "memory", "direct", "peak_extra_anon")
    out = {name: ratio(m.get(num), m.get(den)) for name, (num, den) in PAIRS.items()}
    return {**out,
        "peak_anon_vs_largest": None if peak is None
        else max(0, peak - MEM_FIXED_ALLOWANCE) / largest,
        "peak_anon_raw_vs_largest": None if peak is None else peak / largest,
        "allocator_effect": ratio(lv.get("direct_glibc_malloc"), lv.get("direct")),
        "plan_cache_effect": ratio(lv.get("direct_cold_plan"), lv.get("direct")),
        "fixed_s": lv.get("tiny"), "fixed_vs_direct": ratio(lv.get("tiny"), lv.get("direct")),
        "refresh_share": ratio(median(dig(e, "levers", "direct", "refresh_s")), lv.get("direct")),
        "overlap_effect": ratio(lv.get("overlap_probe_sequential"),
                                lv.get("overlap_probe_overlapped")),
        "audit_s": dig(e, "levers", "audit_s")}

def _multiprocess_ratios(mp: dict[str, Any]) -> dict[str, Any]:
    """The child's other engines, HTTP, and the least-squares fit of the fixed cost."""
    pe, h = ({k: median(v) for k, v in mp.get(key, {}).items()}
             for key in ("pushes_elsewhere", "http"))
    tok = {k: median(v.get("tokens_per_s")) for k, v in mp.get("generation", {}).items()
           if isinstance(v, dict)}
    repack = pe.get(DEFAULT_CPU_LINEAR)
    out: dict[str, Any] = {
        "glibc_engine_push_vs_repack": ratio(pe.get(GLIBC), repack),
        "torch_push_vs_repack": ratio(pe.get(OTHER_CPU_LINEAR), repack),
        "stock_api_reload_vs_repack": ratio(pe.get("stock_api_reload"), repack),
        "http_vs_engine": ratio(h.get("http"), h.get("engine")),
        "http_tiny_vs_engine_tiny": ratio(h.get("http_tiny"), h.get("engine_tiny"))}
    parts = [mp.get("partial", {}).get(k) for k in ("full", "quarter", "lora_attention")]
    points = [(p["bytes"]["median"], p["median"]) for p in parts
              if isinstance(p, dict) and p.get("median") is not None]
    mx, my = (sum(xy[i] for xy in points) / max(1, len(points)) for i in (0, 1))
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if len(points) > 1 and sxx else None
    out["fixed_cost_fit"] = None if slope is None else {"fixed_s": my - slope * mx,
                                                        "s_per_gib": slope * 2**30}
    for key in ("", "_tiny"):
        over, engine = h.get(f"http{key}"), h.get(f"engine{key}")
        out[f"http{key}_overhead_s"] = None if over is None or engine is None else over - engine
    for mode in (OTHER_CPU_LINEAR, GLIBC, "stock"):
        out[f"gen_repack_vs_{mode}"] = ratio(tok.get(DEFAULT_CPU_LINEAR), tok.get(mode))
    return out

def analyse(size: dict[str, Any]) -> dict[str, Any]:
    largest = size["model"]["largest_tensor_bytes"]
    ratios: dict[str, Any] = {e: engine_ratios(size.get(e, {}), largest) for e in ENGINES}
    for where in ("disk", "shm"):
        ratios[f"save_vs_raw_{where}"] = ratio(*(median(dig(size, "save", where, k))
                                                 for k in ("save_checkpoint", "raw_write")))
    ratios["multiprocess_extra"] = _multiprocess_ratios(size.get("multiprocess", {}))
    ratios["gen_repack_vs_stock"] = ratios["multiprocess_extra"]["gen_repack_vs_stock"]
    named = [(f"{e}.{n}", ratios[e].get(n)) for e in ENGINES for n in (
        "direct_vs_read_copy", "layerwise_vs_direct", "peak_anon_vs_largest", "readback_cost")
        if n not in ONLY or (e, size["size"]) in ONLY[n]]
    named += [("inprocess.cold_vs_direct", ratios["inprocess"].get("cold_vs_direct")),
              *((f"save_vs_raw_{w}", ratios[f"save_vs_raw_{w}"]) for w in ("disk", "shm"))]
    if ratios["gen_repack_vs_stock"] is not None:
        named.append(("multiprocess.gen_repack_vs_stock", ratios["gen_repack_vs_stock"]))
    size["ratios"], size["targets"] = ratios, {}
    for name, value in named:
        t = TARGETS[name.rsplit(".", 1)[-1]]
        size["targets"][name] = verdict(value, t["op"], t["value"], t["what"])
    size["correctness"] = correctness(size)
    return size

def correctness(size: dict[str, Any]) -> dict[str, Any]:
    """Each path's outputs against a cold start on B; the bridge's paths are required."""
    ip, mp = size.get("inprocess", {}), size.get("multiprocess", {})
    cold, required = dig(ip, "outputs", "cold_B"), ["direct_inprocess", "direct_multiprocess"]
    checks = {f"{path}_{eng}": harness.compare(dig(e, "outputs", path), cold)
              for eng, e in (("inprocess", ip), ("multiprocess", mp)) for path in
              ("direct", "vllm_api_reload", "layerwise_iter", "layerwise_file", "naive_loop")}
    for key, part, field, needed in (  # stock: vLLM's own engine, A reloaded with B by its API
        *((f"direct_{m}_multiprocess", f"engine_{m}", "parity_vs_own_cold", True)
          for m in (OTHER_CPU_LINEAR, GLIBC)),
        ("stock_own_reload_a_to_b_multiprocess", "engine_stock", "parity_own_reload_a_to_b", False),
        ("partial_chain_multiprocess", "partial", "parity_vs_cold", True)):
        if part in mp:
            checks[key] = mp[part].get(field, {"match": False})
            required += [key] if needed else []
    if "tokens_equal_engine" in mp.get("http", {}):
        checks["http_push_tokens"] = {"match": bool(mp["http"]["tokens_equal_engine"])}
        required.append("http_push_tokens")
    a_out = dig(ip, "outputs", "A")
    discriminates = a_out is not None and cold is not None and a_out != cold
    return {"reference": "greedy output of a cold in-process start on B (same engine settings)",
            "prompts": harness.PARITY_PROMPTS, "max_tokens": harness.PARITY_TOKENS,
            "logprob_tolerance": harness.LOGPROB_TOL,
            "prompts_discriminate_A_from_B": discriminates, "checks": checks,
            "required": required,
            "passed": bool(discriminates and all(checks[k]["match"] for k in required))}

def _cell(kind: str, *keys: str, form: Callable[[Any], str] = fmt) -> Callable[[dict, str], str]:
    """A (size, engine) cell: measurement, ratio or child-only ratio; its target's verdict."""
    where = {"t": [], "r": ["ratios"], "mp": ["ratios", "multiprocess_extra"]}[kind]

    def cell(s: dict, eng: str) -> str:
        if kind == "mp" and eng != "multiprocess":
            return "(multi-process)"
        value = dig(s, *where, *([] if kind == "mp" else [eng]), *keys)
        return form(value) + mark(s.get("targets", {}).get(f"{eng}.{keys[-1]}"))
    return cell

def _by_engine(sizes: dict, title: str, text: str, rows: list[tuple[str, Any]]) -> list[str]:
    cols = [(n, e, f"{n}, {label}") for n in sizes
            for e, label in zip(ENGINES, ("in-process", "multi-process"), strict=True)]
    body = [[label, *(cell(sizes[n], e) for n, e, _ in cols)] for label, cell in rows]
    return [title, "", text, "", *table(["", *(c[2] for c in cols)], body), ""]

def _summary(sizes: dict[str, Any], st: dict[str, Any]) -> list[str]:
    """The push and vLLM's reload, each lever, HTTP and generation speed."""
    s4 = partial(spread, digits=4)
    lines = _by_engine(sizes, "## The default push (issue 24) and vLLM's own reload through "
        "its API (issue 20)", "Same engine, same run, interleaved round-robin; seconds are "
        "median [min–max]. The push is `ColocatedEngine.push`: vLLM's `start_weight_update` / "
        "`update_weights` / `finish_weight_update` with the `weight_bridge` backend (default "
        f"`cpu_linear={DEFAULT_CPU_LINEAR}`, NaN guard, sampled read-back). vLLM's own reload "
        'through the same API is `llm.collective_rpc("reload_weights", kwargs={"weights_path": '
        'DIR, "is_checkpoint_format": True})` plus the prefix-cache reset a push also does; on '
        "vLLM's own engine (no bridge) it ran round-robin with pushes into a bridged engine.", [
        ("read+copy limit (s)", _cell("t", "read_copy", form=s4)),
        ("**push** (s)", _cell("t", "direct", form=s4)),
        ("**push / read+copy** (target ≤ 2.5 in-process at 100m)",
         _cell("r", "direct_vs_read_copy")),
        ("vLLM reload via its API, same engine (s)", _cell("t", "vllm_api_reload", form=s4)),
        ("vLLM reload via its API / push", _cell("r", "vllm_api_reload_vs_direct")),
        ("vLLM reload via its API on vLLM's own engine / push",
         _cell("mp", "stock_api_reload_vs_repack")),
        ("**faster vLLM layerwise / push** (target ≥ 2)", _cell("r", "layerwise_vs_direct")),
        ("generation, repack / vLLM's own engine (target ≥ 0.95)",
         _cell("mp", "gen_repack_vs_stock"))])
    lines += _by_engine(sizes, "## Each lever on its own", "Ratios > 1 mean the lever saves "
        "time: the push without it / the default push, in the same rounds. *glibc default, "
        "switched*: the worker's allocator switched to glibc's default parameters (fixed 128 KiB "
        "thresholds) for that push; *fresh process*: a second engine whose processes never "
        "changed glibc's defaults (`WEIGHT_BRIDGE_MALLOC=default`), pushes round-robin with the "
        "default engine. *Overlap* (writing linear i+1 while linear i is re-packed, in a second "
        "thread) is not in the push; it is probed inside the worker on the engine's own linears "
        "(> 1 would mean it pays).", [
        ("allocator: push with glibc default, switched / push", _cell("r", "allocator_effect")),
        ("allocator: push in a fresh glibc-default engine / push",
         _cell("mp", "glibc_engine_push_vs_repack")),
        ("plan cache: push with the plan dropped / push", _cell("r", "plan_cache_effect")),
        ("plan cache hit on a push", _cell("t", "levers", "plan_cache_hit",
                                           form={None: "n/a", True: "yes", False: "**no**"}.get)),
        ("fixed cost: partial push of one small tensor", _cell("r", "fixed_s", form=MS)),
        ("fixed cost: linear fit over the partial pushes",
         _cell("mp", "fixed_cost_fit", "fixed_s", form=MS)),
        ("one address audit inside the worker (3 per push)", _cell("r", "audit_s", form=MS)),
        ("refresh (re-pack) share of the push", _cell("r", "refresh_share")),
        ("overlap probe: sequential / overlapped write+re-pack", _cell("r", "overlap_effect"))])
    http, gen = [], []
    for n, s in sizes.items():
        h, r = dig(s, "multiprocess", "http") or {}, dig(s, "ratios", "multiprocess_extra") or {}
        if "error" in h:
            http.append([n, f"error: {h['error'][:200]}"])
        elif h:
            http.append([n, s4(h.get("http")), s4(h.get("engine")), fmt(r.get("http_vs_engine")),
                         MS(r.get("http_overhead_s")), s4(h.get("http_tiny")),
                         s4(h.get("engine_tiny")), MS(r.get("http_tiny_overhead_s")),
                         f"{h.get('startup_s', 0):.1f} s"])
        if g := dig(s, "multiprocess", "generation"):
            gen.append([n, *(spread(dig(g, m, "tokens_per_s"), 1) for m in
                             ("repack", GLIBC, "torch", "stock")),
                        fmt(r.get("gen_repack_vs_stock")), fmt(r.get("gen_repack_vs_torch"))])
    return lines + [
        "## HTTP overhead of a push (a `vllm serve` process beside the multi-process engine)", "",
        *table(["size", "push over HTTP (s)", "same push, multi-process engine (s)",
                "HTTP / engine", "overhead", "tiny push over HTTP", "tiny push, engine",
                "tiny overhead", "server start-up"], http), "",
        "## Generation speed (tokens/s)", "", f"Greedy batch of {st.get('gen_batch')} prompts × "
        f"{st.get('gen_tokens')} tokens (prefill included), multi-process engines alive together, "
        f"measured round-robin, {st.get('gen_reps')} reps each. `stock` is vLLM's own engine "
        "without the bridge.", "", *table(["size", "repack", GLIBC, "torch", "stock",
                                           "repack / stock", "repack / torch"], gen), ""]

def render_markdown(results: dict[str, Any]) -> str:
    m, v, st, sizes = results["machine"], results["versions"], results["settings"], results["sizes"]
    load, models, loads = results.get("load", {}), [], harness.fmt_load
    for name, model in ((n, s["model"]) for n, s in sizes.items()):
        arch, tied, source = ((model["arch"], model["tied"], model["source"]) if "source" in model
                              else ("llama", name == harness.REAL_MODEL, model_source(name)))
        kind = "tied embeddings" if tied else "untied"
        models.append(f"{name}: {source}; {arch.capitalize()} architecture, {kind}, "
                      f"{model['dtype']}")
    lines = [
        "# weight-bridge benchmark", "", f"Command: `{results['command']}`  ",
        f"Date: {results['started']}, total {results.get('elapsed_s', 0):.0f} s  ",
        f"Machine: {m['cpu_model']}, {m['cores']} cores, "
        f"{(m['memory_total_bytes'] or 0) / 2**30:.1f} GiB RAM; copy_ bandwidth in the engine "
        f"worker {(m.get('copy_bandwidth_bytes_per_s') or 0) / 1e9:.2f} GB/s (payload, largest "
        "size, multi-process worker)  ",
        f"Versions: torch {v.get('torch')}, vllm {v.get('vllm')}, weight-bridge "
        f"{v.get('weight-bridge')}  ",
        f"Load average start / end: {loads(load.get('loadavg_start'))} / "
        f"{loads(load.get('loadavg_end'))}; CPU used by other processes during the run: "
        f"{100 * (load.get('cpu_other_share') or 0):.0f}% of the machine  ",
        f"Times in seconds, median [min–max] of {st['reps']} reps interleaved round-robin; "
        f"engines run with `{st['engine_kwargs']}`. Models: " + "; ".join(models) + ".", "",
        *_summary(sizes, st)]
    fsdp, inflight = results.get("fsdp"), results.get("inflight")
    if isinstance(fsdp, dict):
        lines += [render_fsdp(fsdp), ""] if "error" not in fsdp and "fsdp" in fsdp else [
            "## FSDP2 sync vs DDP sync", "", f"error: {fsdp.get('error', '')[-500:]}", ""]
    if isinstance(inflight, dict):
        lines += ["## In-flight pushes", "", render_inflight(inflight) if "pauses" in inflight
                  else f"error: {inflight.get('error', '')[-500:]}", ""]
    return "\n".join(lines + _tables(sizes) + _verdicts(sizes)) + "\n"

def _tables(sizes: dict[str, Any]) -> list[str]:
    rows: list[tuple[str, tuple, Callable[[Any], str]]] = [
        (f"CPU share used by other processes during the {e} section",
         (e, "load", "cpu_other_share"), partial(fmt, spec=".0f", unit="%", scale=100))
        for e in ENGINES]
    rows.append(("params / checkpoint MiB / largest tensor MiB", ("model",), lambda mo: (
        f"{mo['params'] / 1e6:.0f}M / {MIB(mo['bytes'])} / {MIB(mo['largest_tensor_bytes'])}")))
    for eng, title in (("multiprocess", "multi-process engine"), ("inprocess", "in-process")):
        rows += [(f"{title}: {label}", (eng, key), spread) for label, key in TIME_ROWS]
    rows += [("in-process: cold restart (ready engine)", ("inprocess", "cold_restart"), spread),
             ("multi-process: engine start-up (1 sample)", ("multiprocess", "startup_s"),
              partial(fmt, spec=".3f", unit="")),
             *((f"multi-process, cpu_linear={mode}: push (engines alive together, round-robin)",
                ("multiprocess", "pushes_elsewhere", mode), spread)
               for mode in (OTHER_CPU_LINEAR, DEFAULT_CPU_LINEAR)),
             *((label, ("save", where, key), spread) for label, where, key in SAVE_ROWS)]
    ratios = [(f"{title}: {label}", e, k) for e, title in
              (("multiprocess", "multi-process"), ("inprocess", "in-process"))
              for label, k in RATIO_ROWS]
    ratios += [("in-process: cold restart / push (target ≥ 100)", "inprocess", "cold_vs_direct"),
               ("multi-process: engine start-up / push", "multiprocess", "startup_vs_direct"),
               ("save / raw write, disk (target ≤ 1.5)", None, "save_vs_raw_disk"),
               ("save / raw write, /dev/shm (target ≤ 1.5)", None, "save_vs_raw_shm")]
    memory = [[n, MIB(s["model"]["largest_tensor_bytes"]), e, path, MIB(p.get("peak_extra_anon")),
               MIB(p.get("peak_extra_file")), MIB(p.get("hwm_extra_total"))]
              for n, s in sizes.items() for e in ENGINES
              for path, p in (dig(s, e, "memory") or {}).items()]
    partials = [[n, kind, fmt(dig(p, "tensors", "median"), ".0f", ""),
                 MIB(dig(p, "bytes", "median")), fmt(p.get("bytes_vs_full", 1.0)), spread(p),
                 fmt(p.get("time_vs_full", 1.0)), fmt(dig(p, "refreshed", "median"), ".0f", "")]
                for n, s in sizes.items() for kind in ("full", "quarter", "lora_attention")
                if (p := dig(s, "multiprocess", "partial", kind))]
    return [
        "## Times (s)", "", *table(["", *sizes], [[label, *(form(dig(s, *keys)) for s in
                                   sizes.values())] for label, keys, form in rows]),
        "", "## Ratios and targets (✓ met, ✗ missed)", "",
        *table(["", *sizes], [[label, *(fmt(dig(s, "ratios", *[e] * (e is not None), k)) + mark(
            s["targets"].get(k if e is None else f"{e}.{k}")) for s in sizes.values())]
            for label, e, k in ratios]),
        "", "## Peak extra resident memory during one run of each path (MiB)", "",
        "RssAnon is memory the path allocated; RssFile is the checkpoint's page cache mapped by "
        "the reader (not a copy); VmHWM is the kernel's exact peak of RSS (anon + file) after a "
        "reset. Sampled every 0.5 ms in a background thread.", "",
        *table(["size", "largest tensor", "engine", "path", "peak extra RssAnon",
                "peak extra RssFile", "VmHWM extra"], memory),
        "", "## Partial pushes (multi-process engine)", "",
        "A full push of B against partial checkpoints on top of it: `quarter` (the top layers, "
        "a quarter of the bytes: frozen lower layers) and `lora_attention` (every attention "
        "projection: LoRA adapters on attention, merged by the callback). Push time median "
        "[min–max]; bytes and time as a fraction of the full push, same engine, same run.", "",
        *table(["size", "push", "tensors", "MiB", "bytes / full", "time (s)", "time / full",
                "modules refreshed"], partials)]

def _verdicts(sizes: dict[str, Any]) -> list[str]:
    lines, notes = ["", "## Correctness (greedy output after the push vs a cold start on B)", "",
                    *table(["check", *sizes], [])], []
    for key in next(iter(sizes.values()))["correctness"]["checks"]:
        cells = ["✓" if dig(s, "correctness", "checks", key, "match") else "✗"
                 for s in sizes.values()]
        if key in LEGACY_CHECKS:  # a check that could not fail: no verdict shown
            notes.append(f"- {key}: {LEGACY_CHECKS[key]}")
            cells = ["n/a (see below)"] * len(sizes)
        lines.append(line([key, *cells]))
    lines.append(line(["**passed** (required: direct, both engines; A and B outputs differ)",
                       *("yes" if s["correctness"]["passed"] else "NO" for s in sizes.values())]))
    missed = [f"- {n}: {k} = {fmt(t['value'])} (target {t['target']})"
              for n, s in sizes.items() for k, t in s["targets"].items() if t["met"] is False]
    errors = [f"- {f'{n}: {e}'[:300]}" for n, s in sizes.items() for e in s.get("errors", [])]
    return [*lines, *([""] + notes if notes else []), "", "## Missed targets", "",
            *(missed or ["none"]), *(["", "## Errors", "", *errors] if errors else [])]
# fmt: on
