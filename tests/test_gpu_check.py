"""``tools/gpu_check.py`` (``make gpu-check``) can fail: without CUDA under ``--require-gpu``,
and on a GPU for any wrong output, exception or refusal in ``auto`` mode. Fast, no GPU used.

The GPU run itself cannot happen here; what is tested is what decides its exit status: the
parity comparison it applies (the CPU tests' parity: tokens exact, logprobs within 1e-4), the
verdict on each matrix cell, the delta memory check (on the CPU), and the exit codes.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TOOL = Path(__file__).resolve().parents[1] / "tools" / "gpu_check.py"
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")


def load_tool():
    spec = importlib.util.spec_from_file_location("gpu_check", TOOL)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = load_tool()

# Two prompts' greedy outputs in the shape of weight_bridge.testing.parity.collect: tokens, then
# per step the top-3 (id, logprob) sorted by id.
OUT = [
    ([5, 9, 9], [[(5, -0.11), (7, -2.5), (9, -3.0)]] * 3),
    ([4, 4], [[(1, -4.0), (4, -0.02), (6, -5.5)]] * 2),
]


def shifted(out: list, prompt: int, step: int, rank: int, by: float) -> list:
    """``out`` with one logprob moved by ``by``."""
    copy = [(list(toks), [list(s) for s in lps]) for toks, lps in out]
    k, v = copy[prompt][1][step][rank]
    copy[prompt][1][step][rank] = (k, v + by)
    return copy


def test_parity_matches_equal_outputs_and_float_noise() -> None:
    assert gpu_check.LOGPROB_TOL == 1e-4
    assert gpu_check.parity_failures(OUT, OUT) == []
    assert gpu_check.parity_failures(shifted(OUT, 1, 1, 0, 3e-6), OUT) == []


def test_parity_flags_a_logprob_off_by_more_than_1e_4() -> None:
    problems = gpu_check.parity_failures(shifted(OUT, 0, 2, 1, 5e-4), OUT)
    assert len(problems) == 1 and "prompt 0 step 2 token 7" in problems[0], problems


def test_parity_flags_a_different_token_and_top_k_id() -> None:
    other_token = [([5, 9, 7], OUT[0][1]), OUT[1]]
    assert any("tokens [5, 9, 7]" in p for p in gpu_check.parity_failures(other_token, OUT))
    other_id = [OUT[0], (OUT[1][0], [[(2, -4.0), (4, -0.02), (6, -5.5)]] * 2)]
    assert any("top-k ids [2, 4, 6]" in p for p in gpu_check.parity_failures(other_id, OUT))
    assert gpu_check.parity_failures(OUT[:1], OUT)  # an output missing


def test_matrix_cell_verdicts() -> None:
    verdict = gpu_check.cell_verdict
    assert verdict("direct", problems=[]) == ("= cold start", True)
    assert verdict("auto", problems=[]) == ("= cold start", True)
    named = {"model.layers.0.mlp.experts.w13_weight": "transformed at load"}
    text, ok = verdict("direct", refused=named, problems=[])
    assert ok and text == "refused (1 weights named), nothing written"
    failing = [
        verdict("auto", refused=named, problems=[]),  # auto must never refuse
        verdict("direct", refused={}, problems=[]),  # a refusal names what it refuses
        verdict("direct", refused=named, problems=["prompt 0: tokens [1], expected [2]"]),
        verdict("direct", problems=["prompt 0 step 1 token 7: logprob ..."]),
        verdict("auto", problems=[], addresses_same=False),
        verdict("direct", error=RuntimeError("CUDA error: an illegal memory access")),
        verdict("auto", error=NotImplementedError("this family is not served")),
    ]
    for text, ok in failing:
        assert not ok and text.startswith("FAIL"), text


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=300
    )


@needs_no_cuda
def test_require_gpu_fails_without_cuda() -> None:
    proc = run_tool("--require-gpu")
    assert proc.returncode == gpu_check.NO_GPU_EXIT != 0, proc
    assert "no CUDA device" in proc.stderr and "FAILED" in proc.stderr, proc.stderr
    matrix = run_tool("--require-gpu", "--matrix")
    assert matrix.returncode == gpu_check.NO_GPU_EXIT, matrix


@needs_no_cuda
def test_without_require_gpu_it_says_it_skipped() -> None:
    proc = run_tool()
    assert proc.returncode == 0 and "SKIPPED" in proc.stdout, proc


def test_an_exception_in_the_check_fails_it(monkeypatch, capsys) -> None:
    # Mocks: a run that raises needs a GPU to get that far, so CUDA is reported present and
    # the check itself raises at once.
    def broken(*args, **kwargs):
        raise RuntimeError("engine failed to start")

    monkeypatch.setattr(gpu_check, "cuda_available", lambda: True)
    monkeypatch.setattr(gpu_check, "single", broken)
    monkeypatch.setattr(gpu_check, "matrix", broken)
    assert gpu_check.main([]) == 1
    assert gpu_check.main(["--matrix"]) == 1
    assert "engine failed to start" in capsys.readouterr().err


def test_the_delta_memory_check_measures_on_the_device_it_is_given(capsys) -> None:
    """``--delta-memory``'s check, run on the CPU (resident memory): a dense and a sparse delta
    within their bound, one line each, exit 0; on a GPU the same function measures
    ``torch.cuda.max_memory_allocated``."""
    assert gpu_check.delta_memory("cpu") == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(line.endswith(": ok") for line in lines), lines
