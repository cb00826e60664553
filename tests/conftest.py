"""Shared fixtures: tiny local models (A, and the perturbed "next policy" B) and real engines.

Engines are expensive (seconds each even eager, on 2 cores), so each architecture's engine is
started once per session and shared; tests that need a specific state push it first.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from weight_bridge.testing import TEST_ARCHITECTURES  # noqa: E402
from weight_bridge.testing.models import build_tiny_model, perturb_checkpoint  # noqa: E402

ENGINE_KWARGS = dict(
    dtype="float32",
    max_model_len=128,
    seed=0,
    max_num_seqs=8,
    enforce_eager=True,
    plugins=(TEST_ARCHITECTURES,),
)

from weight_bridge.testing import parity  # noqa: E402

PROMPTS = parity.PROMPTS


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``{arch}_A`` and ``{arch}_B`` model directories for llama (untied) and qwen2 (tied)."""
    root = tmp_path_factory.mktemp("models")
    out: dict[str, Path] = {}
    for arch in ("llama", "qwen2"):
        a = build_tiny_model(root / f"{arch}_A", arch=arch, seed=0)
        out[f"{arch}_A"] = a
        out[f"{arch}_B"] = perturb_checkpoint(a, root / f"{arch}_B", scale=0.3, seed=1)
    return out


def greedy(engine, prompts=PROMPTS, max_tokens: int = 12, logprobs: int = 3) -> list:
    """Greedy tokens and top-k logprobs per prompt: what parity is judged on."""
    return parity.greedy(engine, prompts, max_tokens=max_tokens, logprobs=logprobs)


def assert_parity(got: list, want: list) -> None:
    """Same tokens, and logprobs equal up to float32 summation-order noise.

    Same configuration, same weights and same batch give bit-identical kernels, but the
    engine's batch composition (and so its reduction order) can differ between a warm and a
    cold engine; 1e-4 on log-probabilities is far below any weight change we push.
    """
    problems = parity.parity_problems(got, want, tol=1e-4)
    assert not problems, "\n".join(problems)


TESTS = Path(__file__).parent


def run_script(
    script: str, *args: str, multiprocess: bool = True, env: dict | None = None
) -> tuple[dict, str]:
    """Run ``tests/<script>`` in its own process; its last ``RESULT {json}`` line and stderr.

    vLLM reads ``VLLM_ENABLE_V1_MULTIPROCESSING`` once per process, so each engine mode gets a
    process of its own.
    """
    import subprocess
    import sys

    flag = "1" if multiprocess else "0"
    full_env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": flag, **(env or {})}
    proc = subprocess.run(
        [sys.executable, str(TESTS / script), *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    return result_of(proc), proc.stderr


def result_of(proc) -> dict:
    """The last ``RESULT {json}`` line a finished test script printed; fails with its stderr if
    it exited non-zero or printed none."""
    import json

    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


def model_dir_with(config_dir: Path, tensors: dict, dst: Path) -> Path:
    """A model directory (``config_dir``'s config and tokenizer) holding ``tensors``: what a
    reference cold start loads."""
    import shutil

    from weight_bridge.checkpoint import save_checkpoint

    shutil.copytree(config_dir, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    save_checkpoint(tensors, dst / "model.safetensors")
    return dst


def run_engine_check(*args: str, multiprocess: bool = True, env: dict | None = None) -> dict:
    """Run ``tests/engine_check.py`` in its own process and return its JSON result."""
    return run_script("engine_check.py", *args, multiprocess=multiprocess, env=env)[0]


_cold_cache: dict[tuple, list] = {}


@pytest.fixture(scope="session")
def cold() -> Callable[..., list]:
    """Greedy outputs of an engine freshly started on ``model`` (own process, cached).

    In-process vLLM engines cannot coexist (they share process-global parallel state), so the
    reference cold start runs beside the engine under test, in a process of its own.
    """

    def run(model: Path, cpu_linear: str = "repack", compile: bool = False) -> list:
        key = (str(model), cpu_linear, compile)
        if key not in _cold_cache:
            args = ["cold", str(model), "--cpu-linear", cpu_linear]
            result = run_engine_check(
                *args, *(["--compile"] if compile else []), multiprocess=False
            )
            _cold_cache[key] = result["cold"]
        return _cold_cache[key]

    return run


_slot: dict[str, object] = {}


def open_engine(model: Path, key: object = None, **kwargs):
    """The one in-process engine: reuse it for the same key, else close it and start anew."""
    from weight_bridge.vllm import ColocatedEngine

    key = key if key is not None else (str(model), tuple(sorted(kwargs.items())))
    if _slot.get("key") != key or _slot.get("engine") is None:
        close_engine()
        started = time.perf_counter()
        _slot["engine"] = ColocatedEngine(model, **{**ENGINE_KWARGS, **kwargs})
        _slot["key"] = key
        print(f"\nengine {model.name} {kwargs} started in {time.perf_counter() - started:.1f} s")
    return _slot["engine"]


def close_engine() -> None:
    engine = _slot.pop("engine", None)
    _slot.pop("key", None)
    if engine is not None:
        engine.close()  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def shared_engine(models) -> Iterator[Callable[..., object]]:
    """``shared_engine(name, **kwargs)``: an in-process engine on ``models[name]``, kept alive
    across tests while they ask for the same one. Tests push the state they need first."""

    def get(name: str, **kwargs):
        return open_engine(models[name], key=(name, tuple(sorted(kwargs.items()))), **kwargs)

    yield get
    close_engine()


@pytest.fixture
def engine_factory() -> Iterator[Callable[..., object]]:
    """A private in-process engine for one test (closes the shared one first)."""

    def make(model: Path, **kwargs):
        return open_engine(model, key=object(), **kwargs)

    yield make
    close_engine()
