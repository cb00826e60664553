"""Shared fixtures: tiny local models (A, and the perturbed "next policy" B) and real engines.

Plain helpers (parity, engines, scripts, fault injection) are in ``helpers.py``; tests import
them from there, never from this file.

Engines are expensive (seconds each even eager, on 2 cores), so each architecture's engine is
started once per session and shared; tests that need a specific state push it first.

``@pytest.mark.must_run_in_ci``: a test that may be skipped where what it needs is missing (a
mount namespace, the real model), but never in CI (``CI`` set, as ``make test`` runs there):
there its skip is reported as a failure.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import close_engine, open_engine, run_engine_check

from weight_bridge.testing.models import build_tiny_model, perturb_checkpoint


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "must_run_in_ci: a skip of this test is a failure when CI is set"
    )


# The heaviest test files first (minutes each on 2 cores: real engines, servers, several
# processes), then the rest in name order. `make test` runs two workers taking a whole file at
# a time, in this order: a heavy file taken last would leave the other worker idle at the end.
HEAVY_FIRST = (
    "test_native_api.py",
    "test_matrix.py",
    "test_transport_integrity.py",
    "test_serve.py",
    "test_engine.py",
    "test_real_model.py",
    "test_relocation_engine.py",
    "test_fsdp_sync.py",
    "test_scaling.py",
    "test_reliability.py",
    "test_adapter_engine.py",
    "test_adapter_sync.py",
    "test_serve_adapters.py",
    "test_quantized.py",
    "test_partial.py",
    "test_callback.py",
    "test_docs_examples.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Under ``CI``, a skipped ``must_run_in_ci`` test fails, with the skip's reason."""
    report = (yield).get_result()
    if not (report.skipped and os.environ.get("CI") and item.get_closest_marker("must_run_in_ci")):
        return
    if hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
    report.outcome = "failed"
    report.longrepr = f"skipped in CI (CI={os.environ['CI']!r}), where it must run: {reason}"


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


_cold_cache: dict[tuple, list] = {}


@pytest.fixture(scope="session")
def cold() -> Callable[..., list]:
    """Greedy outputs of an engine freshly started on ``model`` (own process, cached).

    In-process vLLM engines cannot coexist (they share process-global parallel state), so the
    reference cold start runs beside the engine under test, in a process of its own.
    """

    def many(models: list[Path], cpu_linear: str = "repack", compile: bool = False) -> list:
        """Cold starts of several models from one process (one engine at a time): one
        interpreter and one vLLM import instead of one per model."""
        missing = [m for m in models if (str(m), cpu_linear, compile) not in _cold_cache]
        if missing:
            args = ["cold", *map(str, missing), "--cpu-linear", cpu_linear]
            result = run_engine_check(
                *args, *(["--compile"] if compile else []), multiprocess=False
            )
            for model, outputs in zip(missing, result["colds"], strict=True):
                _cold_cache[(str(model), cpu_linear, compile)] = outputs
        return [_cold_cache[(str(m), cpu_linear, compile)] for m in models]

    def run(model: Path, cpu_linear: str = "repack", compile: bool = False) -> list:
        return many([model], cpu_linear, compile)[0]

    run.many = many  # type: ignore[attr-defined]
    return run


@pytest.fixture(scope="session")
def api_models(tmp_path_factory) -> tuple[Path, dict[str, tuple[Path, Path]]]:
    """A checkpoint root holding the models vLLM's own API is tested on (``vllm.LLM``,
    ``AsyncLLM``, ``vllm serve``): ``dense`` (tied Qwen2) and ``moe`` (Qwen3-MoE), each A and
    its perturbed B. Shared, so their stock cold starts are computed once."""
    from weight_bridge.testing.models import build_matrix_model

    root = tmp_path_factory.mktemp("api-root")
    dense = build_tiny_model(root / "qwen2_A", arch="qwen2", seed=0)
    moe = build_matrix_model(root / "moe_A", "qwen3-moe", seed=0)
    return root, {
        "dense": (dense, perturb_checkpoint(dense, root / "qwen2_B", scale=0.3, seed=1)),
        "moe": (moe, perturb_checkpoint(moe, root / "moe_B", scale=0.3, seed=1)),
    }


@pytest.fixture(scope="session")
def stock_cold() -> Callable[..., list]:
    """Greedy outputs of a *stock* ``vllm.LLM`` (no bridge: vLLM's own loading and processing)
    freshly started on ``model``, on ``prompts`` (default the parity prompts); own process,
    cached."""

    def run(
        model: Path, prompts: list | None = None, max_tokens: int = 12, ignore_eos: bool = False
    ) -> list:
        key = (str(model), json.dumps(prompts), max_tokens, ignore_eos)
        if key not in _cold_cache:
            args = ["stock", str(model), "--max-tokens", str(max_tokens)]
            args += ["--prompts", json.dumps(prompts)] if prompts is not None else []
            args += ["--ignore-eos"] if ignore_eos else []
            _cold_cache[key] = run_engine_check(*args, multiprocess=False)["cold"]
        return _cold_cache[key]

    return run


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
