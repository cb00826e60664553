"""``tools/logprob_probe.py`` (what ``make test-vllm034`` asks first) decides right, on plain data.

The probe's decision is a pure function of the logprobs vLLM reported and a reference
distribution per position (:func:`~tools.logprob_probe.compare_logprobs`), and its exit status
follows from that verdict or from what raised (:func:`~tools.logprob_probe.main`). Both are
checked here with no engine and no GPU, so this runs in the normal suite on every vLLM. The
probe's real run (an engine against Hugging Face) is what ``make test-vllm034`` does; one real
run here (issue 62.5) checks that it is a run of vLLM alone: a bridge whose plugin breaks every
engine does not make the probe skip.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "logprob_probe.py"

pytestmark = pytest.mark.every_vllm


def load_tool():
    spec = importlib.util.spec_from_file_location("logprob_probe", TOOL)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


probe = load_tool()


def log_softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    norm = top + math.log(sum(math.exp(x - top) for x in logits))
    return [x - norm for x in logits]


# A reference row over a vocabulary of 8, and the rows vLLM would report from it: the sampled
# (greedy) token and the top-3.
REF = log_softmax([2.0, -1.0, 0.5, 3.25, -4.0, 1.0, 0.0, -0.5])
TOP = (3, 0, 5)


def rows(shift: float = 0.0, ref: list[float] = REF, n: int = 4) -> list:
    """``n`` positions whose reported logprobs are the reference plus ``shift``."""
    return [
        probe.Row(f"prompt 0 generated token {s}", {t: ref[t] + shift for t in TOP}, ref)
        for s in range(n)
    ]


def test_exact_logprobs_pass() -> None:
    v = probe.compare_logprobs(rows())
    assert v.ok and v.compared == 12 and v.worst == 0.0 and not v.problems


def test_float_noise_of_1e_5_passes() -> None:
    v = probe.compare_logprobs(rows(shift=1e-5))
    assert v.ok, v.problems
    assert v.worst == pytest.approx(1e-5, rel=1e-3)


def test_a_wrong_normalizer_of_3_nats_is_flagged() -> None:
    """What the broken path looked like: every logprob shifted by the same wrong normalizer,
    here 3 nats, which also makes the top token's logprob positive."""
    v = probe.compare_logprobs(rows(shift=3.0))
    assert not v.ok
    assert len(v.problems) == 12
    assert v.worst == pytest.approx(3.0)
    assert any("> 0" in p for p in v.problems)  # top token: REF[3] + 3 > 0
    assert "prompt 0 generated token 0" in v.summary()


def test_a_small_wrong_normalizer_is_flagged() -> None:
    """The mildest wrong normalizer seen (AVX2-tiled code run under AVX-512, on random logits:
    7e-3) exceeds TOL; half of TOL does not."""
    assert not probe.compare_logprobs(rows(shift=7e-3)).ok
    assert probe.compare_logprobs(rows(shift=0.5 * probe.TOL)).ok


def test_a_positive_logprob_is_flagged_even_within_tolerance() -> None:
    """A logprob above 0 is wrong whatever the reference says (here the tolerance is 1 nat)."""
    ref = log_softmax([10.0, 0.0, -1.0])  # the top token's logprob is ~ -5e-5
    v = probe.compare_logprobs([probe.Row("prompt 1 position 2", {0: 0.4}, ref)], tol=1.0)
    assert not v.ok
    assert v.problems == ["prompt 1 position 2 token 0: logprob 0.4 > 0"]


def test_nan_out_of_vocabulary_and_nothing_reported_fail() -> None:
    nan = probe.compare_logprobs([probe.Row("p", {3: float("nan")}, REF)])
    assert not nan.ok and "nan" in nan.problems[0]
    outside = probe.compare_logprobs([probe.Row("p", {8: -1.0}, REF)])
    assert not outside.ok and "outside the vocabulary" in outside.problems[0]
    empty = probe.compare_logprobs([])
    assert not empty.ok and empty.summary() == "no logprob was reported"


def test_minus_infinity_matches_only_minus_infinity() -> None:
    ref = [0.0, float("-inf")]
    assert probe.compare_logprobs([probe.Row("p", {0: 0.0, 1: float("-inf")}, ref)]).ok
    v = probe.compare_logprobs([probe.Row("p", {0: float("-inf")}, ref)])
    assert not v.ok and v.worst == math.inf


def run_main(monkeypatch, tmp_path: Path, outcome) -> tuple[int, str]:
    """:func:`~tools.logprob_probe.main` with ``run`` replaced: ``outcome`` is raised if an
    exception, else returned as ``(verdict, libraries)``."""

    def fake_run(max_tokens: int):
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(probe, "run", fake_run)
    why = tmp_path / "why"
    code = probe.main(["--why", str(why)])
    return code, why.read_text()


def test_exit_0_when_every_logprob_matches(monkeypatch, tmp_path: Path) -> None:
    verdict = probe.compare_logprobs(rows(shift=1e-5))
    code, why = run_main(monkeypatch, tmp_path, (verdict, "_C.abi3.so"))
    assert code == 0
    assert why.startswith("vLLM's logprobs match Hugging Face") and "_C.abi3.so" in why


def test_exit_3_and_why_when_logprobs_do_not_match(monkeypatch, tmp_path: Path) -> None:
    verdict = probe.compare_logprobs(rows(shift=3.0))
    code, why = run_main(monkeypatch, tmp_path, (verdict, "_C_AVX2.abi3.so"))
    assert code == probe.SKIP == 3
    assert why.count("\n") == 1  # one line
    assert "do not match" in why and "_C_AVX2.abi3.so" in why and "worst" in why
    assert "compile cache" in why


def test_exit_3_and_why_when_the_engine_does_not_start(monkeypatch, tmp_path: Path) -> None:
    failure = probe.EngineDidNotStart("RuntimeError: Engine core initialization failed")
    code, why = run_main(monkeypatch, tmp_path, failure)
    assert code == 3
    assert why.startswith("vLLM's engine did not start") and "initialization failed" in why


def test_any_other_failure_is_exit_1_never_a_skip(monkeypatch, tmp_path: Path) -> None:
    code, why = run_main(monkeypatch, tmp_path, KeyError("a bug"))
    assert code == 1
    assert "not a skip" in why


def test_the_plugin_keys_torchs_compile_cache_by_the_cpus_vector_isa(monkeypatch) -> None:
    """Inductor's FX graph cache did not key generated code by the vector width it tiled for:
    a process on another ISA (a simulated AVX2 CPU on a cache an AVX-512 run filled) reused it
    and its logsumexp covered half the vocabulary (logprobs tens of nats off, some above 0).
    The plugin adds the ISA's inputs to torch's own extra cache-key text, keeping other tags."""
    import torch
    import torch.compiler.config as compiler_config

    from weight_bridge.vllm.internals import inductor_cache_isa

    before = compiler_config.cache_key_tag  # set back by hand: monkeypatch's undo hides it
    compiler_config.cache_key_tag = "users-tag"
    try:
        tag = inductor_cache_isa.apply()
        assert tag.startswith("users-tag|" + inductor_cache_isa.TAG_PREFIX)
        assert inductor_cache_isa.apply() == tag  # idempotent
        monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
        assert inductor_cache_isa.apply() != tag  # another ISA, another key
    finally:
        compiler_config.cache_key_tag = before


# -- issue 62.5: the probe runs vLLM without the bridge's plugin ---------------------------------

# In a fresh interpreter with the probe's environment: the general plugins vLLM loads (its own
# loader) and the cache-key tag torch reads at import.
LOADED = (
    "import json, torch.compiler.config as c\n"
    "from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group\n"
    "print(json.dumps([sorted(load_plugins_by_group(DEFAULT_PLUGINS_GROUP)), c.cache_key_tag]))\n"
)


def test_the_probes_vllm_loads_every_plugin_but_the_bridges_and_keeps_the_isa_key() -> None:
    """What vLLM's own plugin loader loads in a process started with the probe's environment
    (as vLLM spawns the engine's): every general plugin installed but the bridge's, where
    without it the bridge's is loaded; and torch's compile-cache key carries the CPU's vector
    ISA, as the bridge's plugin would have set it. A ``VLLM_PLUGINS`` already set is narrowed,
    never widened."""
    import torch.compiler.config as compiler_config

    from weight_bridge.vllm.internals import inductor_cache_isa

    def loaded(env: dict[str, str]) -> tuple[list[str], str]:
        out = subprocess.run(
            [sys.executable, "-c", LOADED], env=env, capture_output=True, text=True, check=True
        ).stdout
        names, tag = json.loads(out.strip().splitlines()[-1])
        return names, tag

    unset = ("VLLM_PLUGINS", "TORCH_COMPILE_CACHE_KEY_TAG")
    base = {k: v for k, v in os.environ.items() if k not in unset}
    plain, _ = loaded(base)
    assert "weight_bridge" in plain  # installed: vLLM loads it everywhere unless told not to
    env, narrowed = dict(base), {**base, "VLLM_PLUGINS": "weight_bridge,another"}
    before = compiler_config.cache_key_tag  # the probe applies the key in its own process too
    try:
        assert probe.keep_the_bridge_out(env) == ["weight_bridge"]
        probe.keep_the_bridge_out(narrowed)
    finally:
        compiler_config.cache_key_tag = before
    names, tag = loaded(env)
    assert names == sorted(set(plain) - {"weight_bridge"})
    assert tag == env["TORCH_COMPILE_CACHE_KEY_TAG"]
    assert inductor_cache_isa.isa_tag() in tag.split("|")
    assert narrowed["VLLM_PLUGINS"] == "another"


# A stand-in for a bridge that breaks every engine: run by the bridge's own plugin
# (``weight_bridge.vllm.plugin.register`` runs the engine plugins of WEIGHT_BRIDGE_PLUGINS in
# every vLLM process), raising as a patch site reported missing does.
BROKEN = """
def register():
    raise RuntimeError("weight-bridge: patch site vllm.v1.engine.core.EngineCore.step is missing")
"""
# Every Python process started with the test's PYTHONPATH records the cache-key tag it inherits.
RECORD = """
import os
if os.environ.get("PROBE_TEST_RECORD"):
    with open(os.environ["PROBE_TEST_RECORD"], "a") as f:
        f.write(f"{os.getpid()} {os.environ.get('TORCH_COMPILE_CACHE_KEY_TAG', '')}\\n")
"""


@pytest.mark.slow
def test_a_bridge_that_breaks_every_engine_does_not_make_the_probe_skip(tmp_path: Path) -> None:
    """Issue 62.5: the bridge's plugin raising in every vLLM process (a patch site reported
    missing) made the probe's engine fail to start: exit 3, and ``make test-vllm034`` skipped
    the subset whose every test would fail. The probe runs vLLM without the bridge's plugin: it
    exits 0 (vLLM runs and its logprobs match here, as the rest of the suite relies on), so the
    subset runs and fails. Every process of the probe's engine got the ISA-keyed cache tag."""
    from weight_bridge.vllm.internals import inductor_cache_isa

    (tmp_path / "broken_bridge_site.py").write_text(BROKEN)
    (tmp_path / "sitecustomize.py").write_text(RECORD)
    record, why = tmp_path / "processes", tmp_path / "why"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
        "WEIGHT_BRIDGE_PLUGINS": "broken_bridge_site:register",
        "PROBE_TEST_RECORD": str(record),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
    }
    env.pop("VLLM_PLUGINS", None)
    env.pop("TORCH_COMPILE_CACHE_KEY_TAG", None)
    done = subprocess.run(
        [sys.executable, str(TOOL), "--why", str(why), "--max-tokens", "4"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    said = why.read_text() if why.exists() else ""
    assert done.returncode == 0, f"exit {done.returncode}: {said}\n{done.stdout[-3000:]}"
    assert said.startswith("vLLM's logprobs match Hugging Face"), said
    tags = [line.split(" ", 1)[1] for line in record.read_text().splitlines()]
    assert len(tags) >= 2 and tags[0] == ""  # the probe, then the engine's processes
    assert set(tags[1:]) == {inductor_cache_isa.isa_tag()}, tags
