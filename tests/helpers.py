"""Plain helpers shared by the tests and the test scripts (no fixtures: those are in conftest).

Tests import them with ``from helpers import ...``: pytest's default (prepend) import mode puts
``tests/`` on ``sys.path``, and a script run as ``python tests/x.py`` has ``tests/`` as
``sys.path[0]``. No test imports another test module (``tests/test_layout_of_tests.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from weight_bridge.testing import TEST_ARCHITECTURES, parity  # noqa: E402

TESTS = Path(__file__).parent

ENGINE_KWARGS = dict(
    dtype="float32",
    max_model_len=128,
    seed=0,
    max_num_seqs=8,
    enforce_eager=True,
    plugins=(TEST_ARCHITECTURES,),
)

PROMPTS = parity.PROMPTS


# -- parity ------------------------------------------------------------------------------------


def greedy(engine, prompts=PROMPTS, max_tokens: int = 12, logprobs: int = 3) -> list:
    """Greedy tokens and top-k logprobs per prompt: what parity is judged on."""
    return parity.greedy(engine, prompts, max_tokens=max_tokens, logprobs=logprobs)


PARITY_TOL = 1e-4


def assert_parity(got: list, want: list) -> None:
    """Same tokens, and logprobs equal up to float32 summation-order noise.

    Same configuration, same weights and same batch give bit-identical kernels, but the
    engine's batch composition (and so its reduction order) can differ between a warm and a
    cold engine; 1e-4 on log-probabilities is far below any weight change we push.
    """
    problems = parity.parity_problems(got, want, tol=PARITY_TOL)
    assert not problems, "\n".join(problems)


def assert_differs(got: list, want: list) -> None:
    """``got`` is really another policy's output than ``want``, not float noise: the parity
    check at the tolerance ``assert_parity`` uses finds problems (a token differs, or a
    logprob differs by more than 1e-4)."""
    problems = parity.parity_problems(got, want, tol=PARITY_TOL)
    assert problems, "the outputs are equal within parity tolerance: the push changed nothing"


# -- engines -----------------------------------------------------------------------------------

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


def model_dir_with(config_dir: Path, tensors: dict, dst: Path) -> Path:
    """A model directory (``config_dir``'s config and tokenizer) holding ``tensors``: what a
    reference cold start loads."""
    from weight_bridge.checkpoint import save_checkpoint

    shutil.copytree(config_dir, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    save_checkpoint(tensors, dst / "model.safetensors")
    return dst


# -- test scripts in their own process ---------------------------------------------------------


def run_script(
    script: str, *args: str, multiprocess: bool = True, env: dict | None = None
) -> tuple[dict, str]:
    """Run ``tests/<script>`` in its own process; its last ``RESULT {json}`` line and stderr.

    vLLM reads ``VLLM_ENABLE_V1_MULTIPROCESSING`` once per process, so each engine mode gets a
    process of its own.
    """
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
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


def run_engine_check(*args: str, multiprocess: bool = True, env: dict | None = None) -> dict:
    """Run ``tests/engine_check.py`` in its own process and return its JSON result."""
    return run_script("engine_check.py", *args, multiprocess=multiprocess, env=env)[0]


# -- a real Lightning run ----------------------------------------------------------------------

VOCAB = 512


def __getattr__(name: str):
    """``TinyLM`` is built on first use (``from helpers import TinyLM``), so that the engine
    scripts importing this module do not pay Lightning's import (seconds on 2 cores)."""
    if name != "TinyLM":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cls = _tiny_lm_class()
    globals()["TinyLM"] = cls
    return cls


def _tiny_lm_class() -> type:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    class TinyLM(pl.LightningModule):
        """A Hugging Face causal LM trained with plain SGD on seeded random tokens.

        ``rollout=True`` makes every training step generate with ``self.vllm_engine``, as an RL
        step would, and records which policy version answered.
        """

        vllm_engine: object | None  # a ColocatedEngine, set by VLLMWeightSync.setup

        def __init__(self, model_path: str, lr: float = 1e-2, rollout: bool = False) -> None:
            super().__init__()
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
            self.lr = lr
            self.rollout = rollout
            self.rollout_versions: list[object] = []

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            if self.rollout:
                from vllm import SamplingParams

                from weight_bridge.vllm import token_prompts

                assert self.vllm_engine is not None
                outs = self.vllm_engine.generate(  # type: ignore[attr-defined]
                    token_prompts([[1, 20, 21]]), SamplingParams(max_tokens=2)
                )
                self.rollout_versions.append(outs[0].policy_version)
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=self.lr)

        def train_dataloader(self) -> DataLoader:
            tokens = torch.randint(4, VOCAB, (64, 16), generator=torch.Generator().manual_seed(0))
            return DataLoader(tokens, batch_size=4)  # type: ignore[arg-type]

    TinyLM.__qualname__ = "TinyLM"  # importable as helpers.TinyLM (pickling, LightningCLI)
    return TinyLM


def trainer(tmp_path: Path, callbacks: list, max_steps: int, **kwargs):
    """A real Lightning ``Trainer`` on CPU, quiet, writing under ``tmp_path``."""
    import lightning.pytorch as pl

    kwargs.setdefault("logger", False)
    return pl.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **kwargs,
    )


# -- fault injection ---------------------------------------------------------------------------


def crash_before_rename(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """A mock: a crash after the data is written and fsynced but before the rename cannot be
    caused for real from inside a test, so the rename to ``name`` raises as a crash would."""
    import weight_bridge.checkpoint.write as checkpoint_write

    real_replace = os.replace

    def crash(src, dst):
        if Path(dst).name == name:
            raise OSError("injected crash before rename")
        return real_replace(src, dst)

    monkeypatch.setattr(checkpoint_write.os, "replace", crash)


class Evil:
    """Unpickling this writes a marker file: proof of whether a pickle was ever executed."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))
