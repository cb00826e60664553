"""The benchmark runs end to end and writes complete, correct-by-construction results.

Only structure and the correctness check are asserted here: speed targets are the benchmark's
own business (it reports them met or missed), never a test's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMING_KEYS = ("median", "min", "max", "q1", "q3", "n", "samples")


def _timed(d: dict) -> None:
    assert "error" not in d, d.get("error")
    for key in TIMING_KEYS:
        assert key in d, key
    assert d["n"] >= 1 and d["median"] is not None


@pytest.mark.slow
@pytest.mark.bench
def test_quick_bench_writes_complete_results(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the bench sets it per process itself
    cmd = [sys.executable, "-m", "benchmarks", "--quick", "--out", str(out)]
    cmd += ["--workdir", str(tmp_path / "work")]
    # benchmarks/ is not installed: run from the repository root, where it is importable
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])

    r = json.loads(out.read_text())
    assert out.with_suffix(".md").stat().st_size > 0
    assert "-m benchmarks" in r["command"] and "--quick" in r["command"]
    for key in ("cpu_model", "cores", "memory_total_bytes", "copy_bandwidth_bytes_per_s"):
        assert r["machine"].get(key) is not None, key
    for key in ("torch", "vllm", "weight-bridge"):
        assert r["versions"].get(key), key
    assert r["load"]["loadavg_start"] and r["errors"] == []
    assert r["correctness_passed"] is True

    size = r["sizes"]["1m"]
    ip, mp, save = size["inprocess"], size["multiprocess"], size["save"]
    for engine in (ip, mp):
        for key in (
            "copy",
            "read_copy",
            "direct",
            "direct_no_finite",
            "direct_verify_hash",
            "vllm_api_reload",
            "layerwise_file",
            "layerwise_iter",
            "naive_loop",
        ):
            _timed(engine[key])
        for key in ("read_s", "write_s", "refresh_s", "readback_s"):
            _timed(engine["direct"][key])
        for key in ("direct", "direct_glibc_malloc", "direct_cold_plan", "tiny"):
            _timed(engine["levers"][key])
        assert engine["levers"]["plan_cache_hit"] is True
        for probe in engine["memory"].values():
            assert probe["samples"] > 0
            assert probe["peak_extra_anon"] is not None and probe["peak_extra_file"] is not None
    _timed(ip["cold_restart"])
    # --quick leaves out the sections that start more engines (generation speed and vLLM's own
    # engine, vllm serve, FSDP2 jobs): make bench runs them
    assert "generation" not in mp and "http" not in mp and "fsdp" not in r and "delta" not in r
    pauses = r["inflight"]["pauses"]
    for mode in ("idle", "none", "recompute", "keep", "drain"):
        assert pauses[mode]["n"] == 2 and 0 < pauses[mode]["median_s"] <= pauses[mode]["p95_s"]
    for where in ("disk", "shm"):
        _timed(save[where]["save_checkpoint"])
        _timed(save[where]["raw_write"])

    for engine_name in ("inprocess", "multiprocess"):
        for name in ("direct_vs_read_copy", "layerwise_vs_direct", "peak_anon_vs_largest"):
            assert size["ratios"][engine_name][name] is not None, (engine_name, name)
        for name in ("layerwise_vs_direct", "peak_anon_vs_largest"):
            assert size["targets"][f"{engine_name}.{name}"]["met"] in (True, False)
    for name in ("inprocess.cold_vs_direct", "save_vs_raw_disk", "save_vs_raw_shm"):
        assert size["targets"][name]["met"] in (True, False), name

    c = size["correctness"]
    assert c["passed"] is True and c["prompts_discriminate_A_from_B"] is True
    assert c["checks"]["direct_inprocess"]["match"] is True
    assert c["checks"]["direct_multiprocess"]["match"] is True


# The figures the documentation quotes, against the one source they come from:
# bench/results.json (`make bench`). Fast: nothing is run but the report's renderer.

RESULTS = ROOT / "bench" / "results.json"


def _results() -> dict:
    return json.loads(RESULTS.read_text())


def _x(value: float, digits: int) -> str:
    return f"{value:.{digits}f}x"


def test_results_md_is_the_rendering_of_results_json(tmp_path: Path) -> None:
    copy = tmp_path / "results.json"
    copy.write_text(RESULTS.read_text())
    cmd = [sys.executable, "-m", "benchmarks", "--render", str(copy)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert copy.with_suffix(".md").read_text() == (ROOT / "bench" / "results.md").read_text()


def test_benchmarks_md_quotes_the_current_results() -> None:
    """Every table line of the current run's sections is a line of bench/results.md, and the
    header gives that run's date and load."""
    current = (ROOT / "docs" / "benchmarks.md").read_text().split("## An earlier run")[0]
    rendered = set((ROOT / "bench" / "results.md").read_text().splitlines())
    tables = [line for line in current.splitlines() if line.startswith("|")]
    assert len(tables) > 40
    assert [line for line in tables if line not in rendered] == []
    r = _results()
    started = r["started"][:16].replace("T", " ")  # 2026-12-01 06:49
    header = current.split("**The run below:**", 1)[1].split("\n\n", 1)[0]
    assert started in " ".join(header.split())
    assert f"{100 * r['load']['cpu_other_share']:.0f} %" in header


def test_readme_numbers_match_results() -> None:
    r = _results()
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Numbers", 1)[1].split("\n## ", 1)[0]
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in table.splitlines()
        if line.startswith("| ") and not line.startswith("| |")
    }

    def row(prefix: str) -> list[str]:
        (key,) = [k for k in rows if k.startswith(prefix)]
        return rows[key]

    sizes = r["sizes"]
    for i, name in enumerate(("100m", "smollm2")):
        ratios, checks = sizes[name]["ratios"], sizes[name]["correctness"]["checks"]
        extra = ratios["multiprocess_extra"]
        assert _x(ratios["inprocess"]["direct_vs_read_copy"], 1) in row("push (vLLM's API")[i]
        reload_cell = row("vLLM's own reload")[i]
        assert _x(ratios["multiprocess"]["vllm_api_reload_vs_direct"], 2) in reload_cell
        # "not equal to a cold start" exactly where the check failed
        wrong = not checks["vllm_api_reload_multiprocess"]["match"]
        assert ("not equal to a cold start" in reload_cell) == wrong, (name, reload_cell)
        assert _x(extra["http_vs_engine"], 2) in row("a push over HTTP")[i]
        assert _x(extra["gen_repack_vs_stock"], 2) in row("generation with the bridge")[i]
        sync = r["sync"]["sizes"][name]["variants"]["default"]["x_two_copies"]
        sync_cell = row("a default sync")[i]
        assert _x(sync, 1) in sync_cell and ("(met)" in sync_cell) == (sync <= 6.0), sync_cell
    fsdp = r["fsdp"]
    cell = row("FSDP2 sync")[0]
    assert f"{fsdp['fsdp']['peak_extra_anon'] / 2**20:.1f} MiB" in cell
    assert f"largest tensor {fsdp['largest_tensor'] / 2**20:.0f}" in cell
    assert _x(fsdp["ratios"]["fsdp_vs_ddp_sync_s"], 2) in cell
    assert _x(r["inflight"]["recipe"]["speedup"], 2) in row("async GRPO recipe")[0]
    pauses = r["inflight"]["pauses"]
    modes = (ROOT / "docs" / "inflight.md").read_text()
    inflight = modes.split("| `inflight` |", 1)[1].split("\n\n", 1)[0]
    for mode, key in (
        ("recompute", "recompute"),
        ("keep", "keep"),
        ("drain", "drain"),
        ("None", "none"),
    ):
        (line,) = [x for x in inflight.splitlines() if x.startswith(f"| `{mode}`")]
        assert f"| {pauses[key]['median_s']:.3f} s |" in line, mode
    assert f"idle engine: {pauses['idle']['median_s']:.3f} s" in modes


def test_design_md_generation_speeds_match_results() -> None:
    gen = _results()["sizes"]["100m"]["multiprocess"]["generation"]
    tok = {mode: gen[mode]["tokens_per_s"]["median"] for mode in ("repack", "torch", "stock")}
    design = (ROOT / "docs" / "design.md").read_text()
    repack = f"{tok['repack'] / tok['stock']:.2f}x stock ({tok['repack']:.1f} vs "
    repack += f"{tok['stock']:.1f} tok/s)"
    torch_ = f"{tok['torch'] / tok['stock']:.2f}x stock ({tok['torch']:.1f} tok/s)"
    assert repack in design and torch_ in design


# The delta sync section's own results (`make bench-delta`), and what the docs quote of them.

RESULTS_DELTA = ROOT / "bench" / "results-delta.json"


def _delta() -> dict:
    return json.loads(RESULTS_DELTA.read_text())["delta"]


def _rendered(results: Path, tmp_path: Path) -> str:
    """The .md that ``python -m benchmarks --render`` writes for a copy of ``results``."""
    copy = tmp_path / results.name
    copy.write_text(results.read_text())
    cmd = [sys.executable, "-m", "benchmarks", "--render", str(copy)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return copy.with_suffix(".md").read_text()


def test_results_delta_md_is_the_rendering_of_results_delta_json(tmp_path: Path) -> None:
    rendered = _rendered(RESULTS_DELTA, tmp_path)
    assert rendered == (ROOT / "bench" / "results-delta.md").read_text()


def test_benchmarks_md_quotes_the_delta_results() -> None:
    """Every table line of docs/benchmarks.md#delta-sync is a line of bench/results-delta.md,
    every (size, lr) run and target is there, and the header gives that run's date."""
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    section = doc.split("\n## Delta sync\n", 1)[1].split("\n## ", 1)[0]
    rendered = set((ROOT / "bench" / "results-delta.md").read_text().splitlines())
    tables = [line for line in section.splitlines() if line.startswith("|")]
    assert [line for line in tables if line not in rendered] == []
    d = _delta()
    runs = [(size, lr) for size, s in d["sizes"].items() for lr in s["runs"]]
    assert len(runs) == 4
    targets = sum(len(d["sizes"][size]["runs"][lr]["targets"]) for size, lr in runs)
    assert len(tables) == 3 * 2 + 2 * len(runs) + len(runs) + targets
    assert d["started"][:16].replace("T", " ") in " ".join(section.split())
    assert "--only delta --out bench/results-delta.json" in d["command"]


def test_readme_delta_numbers_match_results() -> None:
    d = _delta()
    readme = (ROOT / "README.md").read_text()
    (line,) = [x for x in readme.splitlines() if x.startswith("Delta sync (`make bench-delta`")]
    for size, label in (("100m", "100m"), ("smollm2", "SmolLM2")):
        slow, fast = d["sizes"][size]["runs"]["1e-06"], d["sizes"][size]["runs"]["1e-05"]
        assert f"{100 * slow['ratios']['bytes_largest']:.1f} % ({label})" in line
        met = "met" if slow["targets"]["vllm_patches"]["met"] else "missed"
        assert f"{slow['ratios']['vllm_patches']:.2f}x ({label}: {met})" in line
        assert f"{fast['ratios']['vllm_patches']:.2f}x ({label})" in line.split("at lr 1e-5")[1]
        assert f"{slow['ratios']['save_apply']:.2f}x ({label})" in line
        assert slow["targets"]["bytes"]["met"] and not slow["targets"]["save_apply"]["met"]
        assert all(r["targets"]["zero_drift"]["met"] for r in (slow, fast))  # "zero drift: met"
    floors = [r["ratios"]["diff_floor"] for s in d["sizes"].values() for r in s["runs"].values()]
    assert f"{min(floors):.2f}x to {max(floors):.2f}x" in line  # the diff with nothing changed


def test_readme_default_sync_numbers_match_results() -> None:
    """The README's line on the default sync (``make bench-default``) quotes the section: the
    default against a complete sync and two memory copies through ``/dev/shm``, deltas there,
    and where deltas win (a disk at lr 1e-6)."""
    d = _results()["default"]
    readme = (ROOT / "README.md").read_text()
    (line,) = [x for x in readme.splitlines() if x.startswith("Default sync (`make bench-default`")]
    cases = d["sizes"]["100m"]["cases"]
    fp32, bf16, disk = (
        cases[c] for c in ("ram_fp32_lr1e-4", "ram_bf16_lr1e-4", "disk_bf16_lr1e-6")
    )
    assert d["started"][:10] in line
    for case, label in ((fp32, "fp32"), (bf16, "bf16")):
        assert sum(case["variants"]["default"]["deltas"]) == 0  # "sends no delta"
        assert f"{_x(case['default_vs_complete'], 2)} ({label})" in line
        assert f"{_x(case['default_x_two_copies'], 1)} ({label})" in line
        assert f"{_x(case['delta_vs_complete'], 1)} ({label})" in line
    met = all(c["target"]["met"] for c in (fp32, bf16))
    assert f"(targets 1.1x and 4.7x: {'met' if met else 'missed'})" in line
    assert f"deltas cost {_x(disk['delta_vs_complete'], 2)}" in line
    assert f"the default {_x(disk['default_vs_complete'], 2)}" in line


# The engine in the ranks (`make bench-ranks`) and other clients during pushes
# (`make bench-clients`): their own results, and what the docs quote of them.

SECTIONS = {
    "ranks": ("Engine in the ranks", "Engine in the ranks (`make bench-ranks`"),
    "clients": ("Other clients during pushes", "Other clients of a served engine"),
}


def _own(name: str) -> dict:
    return json.loads((ROOT / "bench" / f"results-{name}.json").read_text())


@pytest.mark.parametrize("name", list(SECTIONS))
def test_a_sections_md_is_its_json_rendered_and_the_docs_quote_it(
    name: str, tmp_path: Path
) -> None:
    """``bench/results-{name}.md`` is the rendering of its JSON; every table line of its
    section of docs/benchmarks.md is a line of it, and the section names the run's date."""
    rendered = (ROOT / "bench" / f"results-{name}.md").read_text()
    assert _rendered(ROOT / "bench" / f"results-{name}.json", tmp_path) == rendered
    heading = SECTIONS[name][0]
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    section = doc.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    tables = [line for line in section.splitlines() if line.startswith("|")]
    assert tables and [line for line in tables if line not in rendered.splitlines()] == []
    d = _own(name)
    assert f"one run of {(d.get('started') or d['finished'])[:10]}" in " ".join(section.split())


def test_readme_quotes_the_ranks_and_clients_results() -> None:
    readme = (ROOT / "README.md").read_text()
    (line,) = [x for x in readme.splitlines() if x.startswith(SECTIONS["ranks"][1])]
    r = _own("ranks")
    m = r["median_s"]
    assert f"{m['live'] / m['copy']:.1f}x one copy" in line
    met = "met" if r["target_met"] else "missed"
    factor = r["target"].split("<= ")[1].split("x")[0].removesuffix(".0")  # as the run stated it
    assert (
        f"{r['live_without_repack_over_copy']:.1f}x without the CPU re-pack; "
        f"target {factor}x: {met}" in line
    )
    t = r["targets"]["live_vs_load_weights_refresh"]
    both = r["correct"]["live"] and r["correct"]["load_weights_refresh"]
    assert (
        f"{t['value']:.2f}x TRL's per-parameter `load_weights` followed by the same refresh" in line
    )
    assert f"(target {t['limit']}x: {'met' if t['met'] else 'missed'}" in line and both
    wrong = "is wrong" if not r["correct"]["load_weights"] else "is right"
    assert (
        f"`load_weights` alone, {m['load_weights'] / m['copy']:.1f}x, {wrong} on this CPU" in line
    )
    assert f"off the push ({r['store_refresh_s'] / m['copy']:.1f}x)" in line
    assert r["correct"]["live"]
    c = _own("clients")
    phases = c["phases"]
    errors, sent = (
        sum(p["errors"] for p in phases.values()),
        sum(p["sent"] for p in phases.values()),
    )
    assert (
        f"{errors} errors in {sent} requests (target: {'met' if errors == 0 else 'missed'})" in line
    )
    assert f"p99 {phases['no pushes']['latency_p99_s']:.3f} s without pushes" in line
    worst = max(p["latency_p99_s"] for p in phases.values())
    assert f"at most {worst:.3f} s with" in line


def test_ranks_md_shows_trls_way_with_the_same_refresh_and_both_targets() -> None:
    """A run that measured ``load_weights_refresh`` renders its row and both targets (the
    committed run predates it: its table stays as the docs quote it)."""
    from benchmarks.harness import verdict
    from benchmarks.ranks import TARGET_FACTOR, TARGET_VS_ANCHOR, render

    r = _own("ranks")
    m = {**r["median_s"], "load_weights_refresh": 2 * r["median_s"]["load_weights"]}
    live = m["live"] / m["load_weights_refresh"]
    targets = {
        "live_without_repack": verdict(r["live_without_repack_over_copy"], "<=", TARGET_FACTOR, ""),
        "live_vs_load_weights_refresh": verdict(live, "<=", TARGET_VS_ANCHOR, ""),
    }
    met = targets["live_without_repack"]["met"]
    run = {
        **r,
        "median_s": m,
        "targets": targets,
        "target_met": met,
        "target": f"live - repack <= {TARGET_FACTOR}x copy",
        "correct": {**r["correct"], "load_weights_refresh": True},
    }
    text = render(run)
    assert f"(target {TARGET_FACTOR}x: {'met' if met else 'missed'})" in text
    row = [x for x in text.splitlines() if x.startswith("| TRL's way followed by the same refresh")]
    assert len(row) == 1 and f"this mode {live:.2f}x it, target {TARGET_VS_ANCHOR}x" in row[0]
    assert "equals a cold start: yes" in row[0]
    assert render(r) == (ROOT / "bench" / "results-ranks.md").read_text()


def test_benchmarks_is_one_small_harness() -> None:
    """At most 3,000 lines, no function over 80, no private name of the library imported, and
    one command: every section behind ``--only``."""
    import ast

    from benchmarks.__main__ import REGISTRY

    files = sorted((ROOT / "benchmarks").rglob("*.py"))
    assert sum(len(f.read_text().splitlines()) for f in files) <= 3000
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno < 80, (f.name, node.name)
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [*node.module.split("."), *(a.name for a in node.names)]
                private = [n for n in names if n.startswith("_") and n != "__future__"]
                assert not private, (f.name, node.module, private)
    sections = {"fsdp", "inflight", "sync", "vllm034", "delta", "default", "ranks", "clients"}
    assert set(REGISTRY) == sections
