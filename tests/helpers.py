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
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engines read checkpoints only under their checkpoint root: the tests' files all live in the
# system's temporary directory (pytest's tmp_path, tempfile); tests of the root set their own.
os.environ.setdefault("WEIGHT_BRIDGE_CHECKPOINT_ROOT", tempfile.gettempdir())
# Every process the tests start (a script, a `vllm serve` server, an engine core, a
# tensor-parallel worker, a trainer's rank) imports the tests' own modules by name: the fault
# plugin ``faults:register`` (``faults.py``) above all. Python puts ``tests/`` on ``sys.path``
# only for the process that runs a file in it; the environment carries it to all the others.
_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [_TESTS_DIR, os.environ.get("PYTHONPATH")])
    )

from weight_bridge.checkpoint import (  # noqa: E402
    BASE_VERSION_KEY,
    CheckpointReader,
    save_checkpoint,
)
from weight_bridge.testing import TEST_ARCHITECTURES, parity  # noqa: E402
from weight_bridge.testing.deltas import delta_checkpoint  # noqa: E402, F401  (the tests' one)

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

# `vllm serve` on the tiny models, as the tests start it (block size: CPU attention's smallest)
SERVE_ARGS = ["--dtype", "float32", "--max-model-len", "128", "--enforce-eager"]
SERVE_ARGS += ["--max-num-seqs", "8", "--seed", "0", "--block-size", "32"]


def for_model(model: str | Path, kwargs: dict) -> dict:
    """``kwargs`` for an engine on ``model``: an MLA model (DeepSeek) asks for vLLM's reference
    CPU MLA backend. On a CPU with AMX, vLLM otherwise picks its AMX MLA backend, whose weight
    packing takes only bf16, fp16, int8 or fp8 weights, and these tests run float32."""
    config = json.loads((Path(model) / "config.json").read_text())
    if config.get("kv_lora_rank"):
        return {"attention_backend": "CPU_MLA", **kwargs}
    return kwargs


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


CHANGED_LOGPROB = 1e-3  # "far more" than PARITY_TOL; float32 noise between engines is ~1e-6


def assert_differs(got: list, want: list) -> None:
    """``got`` is really another policy's output than ``want``, not float noise: the parity
    check ``assert_parity`` uses finds problems, and they include a different token (or top-k
    id), or a logprob off by more than ``CHANGED_LOGPROB`` (ten times the parity tolerance)."""
    found = parity.check_parity(got, want, tol=PARITY_TOL)
    assert found.problems, "the outputs are equal within parity tolerance: nothing changed"
    assert not found.tokens_equal or found.max_logprob_diff > CHANGED_LOGPROB, (
        f"same tokens and logprobs within {found.max_logprob_diff:.2g}: float noise, not a "
        f"different policy ({found.problems[0]})"
    )


def assert_recompute_continues(
    prompts: list, outputs: list, model: Path, stock_cold: Callable, length: int
) -> None:
    """Each output, interrupted by one push in ``recompute`` mode, has exactly two spans
    (``old``, ``new``) covering its ``length`` tokens, and the tokens after the push are what a
    stock cold start on ``model`` (the new weights) continues prompt + tokens before it with.
    ``outputs[i]`` is ``(tokens, [(version, start, end), ...])``."""
    continuations, expected = [], []
    for i, (ids, (tokens, spans)) in enumerate(zip(prompts, outputs, strict=True)):
        assert len(tokens) == length, f"prompt {i}: {len(tokens)} tokens"
        assert [s[0] for s in spans] == ["old", "new"], spans
        cut = spans[1][1]
        assert spans[0][1:] == (0, cut) and spans[1][2] == length, spans
        continuations.append(list(ids) + list(tokens[:cut]))
        expected.append(list(tokens[cut:]))
    longest = max(len(want) for want in expected)
    cold = stock_cold(model, continuations, max_tokens=longest, ignore_eos=True)
    for i, want in enumerate(expected):
        assert cold[i][0][: len(want)] == want, f"prompt {i}: {cold[i][0]} vs {want}"


# -- version labels under load -----------------------------------------------------------------

LABEL_PROMPTS = [[1, 20, 21, 22], [1, 5, 9, 30, 31], [1, 100, 101]]
LABEL_TOKENS = 6  # greedy, ignore_eos: every output has exactly this many tokens
Labelled = tuple[int, list[int], list[tuple[str, int, int]]]  # prompt index, tokens, spans


def pushes_under_load(
    generate: Callable[[list[int]], tuple[list[int], list[tuple[str, int, int]]]],
    push: Callable[[Path, str], object],
    checkpoints: dict[str, Path],
    pushes: int,
    gap_s: float = 0.02,
    threads: int = 4,
) -> list[Labelled]:
    """``threads`` threads generate :data:`LABEL_PROMPTS` (``generate(ids) -> (tokens,
    spans)``) without a break while ``push(path, version)`` alternates ``checkpoints`` (version:
    its key) ``pushes`` times, each once every thread finished an output begun after the last
    push (and ``gap_s``); every output that finished."""
    stop = threading.Event()
    outputs: list[Labelled] = []
    errors: list[BaseException] = []
    counts = [0] * threads

    def run(k: int) -> None:
        i = k
        while not stop.is_set():
            p = i % len(LABEL_PROMPTS)
            try:
                tokens, spans = generate(LABEL_PROMPTS[p])
            except BaseException as exc:
                errors.append(exc)
                return
            outputs.append((p, list(tokens), [tuple(s) for s in spans]))  # type: ignore[misc]
            counts[k] += 1
            i += 1

    workers = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(threads)]
    for w in workers:
        w.start()
    names = list(checkpoints)
    try:
        for n in range(pushes):
            name = names[n % len(names)]
            push(checkpoints[name], name)
            # every thread finishes one output begun after the push (wholly on this version),
            # then the next push lands while their next ones are running
            want = [c + 2 for c in counts]
            deadline = time.monotonic() + 60
            while any(c < w for c, w in zip(counts, want, strict=True)) and not errors:
                assert time.monotonic() < deadline, "generation stalled"
                time.sleep(0.005)
            time.sleep(gap_s)
            assert not errors, errors
    finally:
        stop.set()
        for w in workers:
            w.join(120)
    assert not errors, errors
    return outputs


def label_colds(a: Path, b: Path, stock_cold: Callable) -> dict[str, list]:
    """Stock cold starts on A and B of :data:`LABEL_PROMPTS`, by version ``"A"`` / ``"B"``."""
    return {
        v: stock_cold(m, LABEL_PROMPTS, LABEL_TOKENS, ignore_eos=True)
        for v, m in (("A", a), ("B", b))
    }


def assert_labels_name_weights(
    outputs: list[Labelled], cold: dict[str, list], min_single: int = 10
) -> tuple[int, int]:
    """Every output's spans are contiguous and cover its tokens; every output under a single
    version is what a cold start on that version generates (``cold[version][prompt]``: greedy
    tokens first; two names may share one cold start), and each cold start was seen. How many
    outputs had one span and how many several."""
    wrong, single, mixed = [], 0, 0
    for p, tokens, spans in outputs:
        assert len(tokens) == LABEL_TOKENS, (p, tokens)
        assert spans and spans[0][1] == 0 and spans[-1][2] == len(tokens), spans
        pairs = zip(spans, spans[1:], strict=False)
        assert all(a[2] == b[1] and a[0] != b[0] for a, b in pairs), spans
        if len(spans) > 1:
            mixed += 1
            continue
        single += 1
        version = spans[0][0]
        if tokens != list(cold[version][p][0]):
            wrong.append((version, p, tokens, cold[version][p][0]))
    assert not wrong, (
        f"{len(wrong)} of {single} single-version outputs are not their version's: {wrong[:3]}"
    )
    assert single >= min_single, (single, mixed)
    seen = {spans[0][0] for _, _, spans in outputs if len(spans) == 1}
    weights = {id(cold[v]) for v in seen}  # a version may have two names (aliases)
    assert len(weights) == len({id(c) for c in cold.values()}), f"outputs under one of {seen}"
    return single, mixed


# -- engines -----------------------------------------------------------------------------------

_slot: dict[str, object] = {}


def open_engine(model: Path, key: object = None, **kwargs):
    """The one in-process engine: reuse it for the same key, else close it and start anew."""
    from weight_bridge import ColocatedEngine

    key = key if key is not None else (str(model), tuple(sorted(kwargs.items())))
    if _slot.get("key") != key or _slot.get("engine") is None:
        close_engine()
        started = time.perf_counter()
        _slot["engine"] = ColocatedEngine(model, **for_model(model, {**ENGINE_KWARGS, **kwargs}))
        _slot["key"] = key
        print(f"\nengine {model.name} {kwargs} started in {time.perf_counter() - started:.1f} s")
    return _slot["engine"]


def lora_greedy(engine, prompts: list, lora_request=None) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens (8) and each one's logprob from ``engine``'s own ``vllm.LLM`` with
    ``lora_request`` (None: the base): what the adapter tests compare, bit for bit."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1)
    outs = engine.llm.generate(prompts, params, lora_request=lora_request, use_tqdm=False)
    return [
        (
            list(o.outputs[0].token_ids),
            [
                lp[t].logprob
                for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)
            ],
        )
        for o in outs
    ]


def close_engine() -> None:
    engine = _slot.pop("engine", None)
    _slot.pop("key", None)
    if engine is not None:
        engine.close()  # type: ignore[attr-defined]


class UserWorkerExtension:
    """A user's own vLLM worker extension, unrelated to the bridge (``self`` is vLLM's worker):
    passed as ``worker_extension_cls="helpers.UserWorkerExtension"``."""

    model_runner: object

    def user_weight_sum(self, name: str) -> float:
        """The sum of the model's parameter ``name``, computed in the worker."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return float(dict(model.named_parameters())[name].double().sum())


def model_dir_with(config_dir: Path, tensors: dict, dst: Path) -> Path:
    """A model directory (``config_dir``'s config and tokenizer) holding ``tensors``: what a
    reference cold start loads."""
    from weight_bridge.checkpoint import save_checkpoint

    shutil.copytree(config_dir, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    save_checkpoint(tensors, dst / "model.safetensors")
    return dst


def tensors_of(model_dir: Path) -> dict:
    with CheckpointReader(model_dir / "model.safetensors") as reader:
        return {name: t.clone() for name, t in reader.tensors()}


def partial_checkpoint(src: Path, names: list[str], base: str, version: str, path: Path) -> Path:
    """``names`` taken from ``src``, saved as a partial checkpoint on top of ``base``."""
    tensors = tensors_of(src)
    metadata = {BASE_VERSION_KEY: base, "version": version}
    save_checkpoint({n: tensors[n] for n in names}, path, metadata)
    return path


def set_storage(p: torch.Tensor, buf: torch.Tensor, offset: int, shape, stride) -> None:
    """Point ``p`` at ``buf``'s storage (what post-load processing does when it moves a
    weight into another buffer)."""
    with torch.no_grad():
        p.set_(buf.untyped_storage(), offset, tuple(shape), tuple(stride))


def keyframe_checkpoint(tensors: dict, version: str, path: Path) -> Path:
    """A complete checkpoint as the trainer writes a keyframe: every tensor's exact
    fingerprint in its header (the base of the deltas after it)."""
    import json

    from weight_bridge.delta.format import FINGERPRINTS_KEY
    from weight_bridge.exact import exact_fingerprint, format_fingerprint

    prints = {n: format_fingerprint(exact_fingerprint(t)) for n, t in tensors.items()}
    metadata = {"version": version, FINGERPRINTS_KEY: json.dumps(prints)}
    save_checkpoint(tensors, path, metadata)
    return path


def engine_cast(tensors: dict, dtypes: dict[str, str]) -> dict:
    """The trainer's cast: each tensor in the dtype the engine reported holding it in (a
    complete push's ``report.dtypes``)."""
    return {n: t.to(getattr(torch, dtypes[n])) if n in dtypes else t for n, t in tensors.items()}


def mixed(old: dict, new: dict, fraction: float, seed: int) -> dict:
    """``old`` with a random ``fraction`` of every tensor's elements taken from ``new``."""
    g = torch.Generator().manual_seed(seed)
    return {
        n: torch.where(torch.rand(t.shape, generator=g) < fraction, new[n], t)
        for n, t in old.items()
    }


def equivalent_full(base_dir: Path, parts: list[tuple[Path, list[str]]], dst: Path) -> Path:
    """A model directory holding ``base_dir``'s weights with each part's names replaced."""
    tensors = tensors_of(base_dir)
    for src, names in parts:
        other = tensors_of(src)
        tensors.update({n: other[n] for n in names})
    return model_dir_with(base_dir, tensors, dst)


def model_dir_saved_by_hf(config_dir: Path, model, dst: Path) -> Path:
    """A reference model directory built without the bridge's code: ``config_dir``'s config and
    tokenizer, and ``model``'s (a Hugging Face model's) weights as its own ``save_pretrained``
    writes them (safetensors from torch's ``state_dict``; a tied ``lm_head`` left out, as
    Hugging Face does)."""
    weights = ("*.safetensors", "*.safetensors.index.json")
    shutil.copytree(config_dir, dst, ignore=shutil.ignore_patterns(*weights))
    with tempfile.TemporaryDirectory() as saved:
        model.save_pretrained(saved, safe_serialization=True)
        for f in Path(saved).iterdir():
            if f.name.endswith((".safetensors", ".safetensors.index.json")):
                shutil.copy(f, dst / f.name)
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
    """``TinyLM`` and ``PushWatcher`` are built on first use (``from helpers import TinyLM``), so
    that the engine scripts importing this module do not pay Lightning's import (seconds on 2
    cores)."""
    builders = {"TinyLM": _tiny_lm_class, "PushWatcher": _push_watcher_base}
    if name not in builders:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cls = builders[name]()
    globals()[name] = cls
    return cls


def _tiny_lm_class() -> type:
    import lightning.pytorch as pl
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
                assert self.vllm_engine is not None
                outs = self.vllm_engine.generate(  # type: ignore[attr-defined]
                    [[1, 20, 21]], {"max_tokens": 2}
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


def _push_watcher_base() -> type:
    import lightning.pytorch as pl

    class PushWatcher(pl.Callback):
        """Listed after the sync callback: calls ``seen(trainer, pl_module, record)`` once per
        push (``record``: the sync's history entry), at the first hook after it landed."""

        def __init__(self, sync) -> None:
            self.sync = sync
            self.pushes: list[dict] = []

        def seen(self, trainer, pl_module, record: dict) -> dict:
            raise NotImplementedError

        def _look(self, trainer, pl_module) -> None:
            if len(self.sync.history) != len(self.pushes):
                self.pushes.append(self.seen(trainer, pl_module, self.sync.history[-1]))

        def on_train_start(self, trainer, pl_module):
            self._look(trainer, pl_module)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self._look(trainer, pl_module)

        def on_train_end(self, trainer, pl_module):
            self._look(trainer, pl_module)

    return PushWatcher


def engine_options_cli(model: Path, tmp_path: Path, options: str):
    """LightningCLI building the callback from a YAML whose engine (mode ``serve``) has the
    ``options`` given as YAML flow text (nothing runs, nothing starts)."""
    from lightning.pytorch.cli import LightningCLI

    path = tmp_path / "config.yaml"
    path.write_text(
        "trainer:\n  logger: false\n  callbacks:\n    - class_path: callbacks.VLLMWeightSync\n"
        f"      init_args:\n        engine: {{model: {model}, mode: serve, options: {options}}}\n"
        f"model:\n  model_path: {model}\n"
    )
    cls = globals().get("TinyLM") or __getattr__("TinyLM")
    return LightningCLI(cls, run=False, args=["--config", str(path)], save_config_callback=None)


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


def weights_digest(worker) -> str:
    """SHA-256 of every parameter's bytes, in name order (observation only)."""
    import hashlib

    import torch

    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in sorted(worker.model_runner.get_model().named_parameters()):
            h.update(name.encode())
            h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


FAULT_PARAM = "model.layers.1.mlp.down_proj.weight"  # written mid-way through a push


def arm_fault(worker, name: str, action: str) -> int:
    """FAULT INJECTION (sent to the workers with ``collective_rpc``): wrap one parameter's
    ``weight_loader`` so that its next call fails. None of these can be caused from outside on
    a healthy machine.

    ``raise``: an exception; ``interrupt``: ``KeyboardInterrupt``; ``exit``: the worker process
    exits; ``kill-core``: the worker SIGKILLs its parent, the engine core process; ``hang``: the
    loader never returns; ``skip``: it returns without writing; ``clobber``: it writes, then adds
    1 to the parameter. One shot: the original loader is put back first.
    """
    import signal

    param = dict(worker.model_runner.get_model().named_parameters())[name]
    original = param.weight_loader

    def faulty(*args, **kwargs):
        param.weight_loader = original
        if action == "raise":
            raise RuntimeError(f"injected fault in the weight loader of {name}")
        if action == "interrupt":
            raise KeyboardInterrupt
        if action == "exit":
            os._exit(17)
        if action == "kill-core":
            os.kill(os.getppid(), signal.SIGKILL)
            time.sleep(5)
            os._exit(18)
        if action == "hang":
            time.sleep(3600)
        if action == "skip":  # a loader that drops the tensor without a word
            return None
        if action == "clobber":  # a loader whose write is changed after it (a bad kernel)
            out = original(*args, **kwargs)
            param.data.add_(1.0)
            return out
        raise ValueError(action)

    param.weight_loader = faulty
    return os.getpid()


def arm_write_fault(worker, action: str = "raise") -> int:
    """FAULT INJECTION: the next call of ``FAULT_PARAM``'s weight loader raises (``raise``) or
    is interrupted (``interrupt``), mid-way through a push."""
    return arm_fault(worker, FAULT_PARAM, action)


def arm_cache_fault(engine, before: Callable | None = None) -> None:
    """FAULT INJECTION (the engine core, in-process only): its next prefix-cache reset, the
    step after the workers wrote, raises (``before(core)`` first). One shot."""
    core = engine.llm.llm_engine.engine_core.engine_core  # InprocClient's EngineCore

    def faulty(*args, **kwargs):
        del core.reset_prefix_cache  # one shot: the class's method again
        if before is not None:
            before(core)
        raise RuntimeError("injected fault in reset_prefix_cache")

    core.reset_prefix_cache = faulty


def input_embedding_kernels(worker) -> dict[str, str]:
    """Sent to the workers with ``collective_rpc``: per input embedding of the model, whether
    its ``cpu_linear`` is a packed oneDNN handle (``"packed"``) or still the bridge's packer,
    waiting for generation to use it (``"first use"``)."""
    from weight_bridge.vllm.internals.model import is_input_embedding
    from weight_bridge.vllm.internals.patches import cpu_linear_of

    def state(module) -> str:
        return "first use" if cpu_linear_of(module).__name__ == "pack_then_compute" else "packed"

    model = worker.model_runner.get_model()
    return {name: state(m) for name, m in model.named_modules() if is_input_embedding(m)}


def bad_checkpoints(models: dict[str, Path], tmp: Path) -> list[tuple]:
    """Real bad files for llama_A's engine: (label, path, push kwargs, error type, words, file
    named, tensor named)."""
    import pickle
    import struct

    import torch
    from safetensors.torch import load_file, save_file

    from weight_bridge.checkpoint import CheckpointError, save_checkpoint
    from weight_bridge.checkpoint.format import INDEX_NAME
    from weight_bridge.direct import DirectReloadError
    from weight_bridge.testing.models import build_tiny_model

    src = models["llama_B"] / "model.safetensors"
    b = load_file(src)
    out: list[tuple] = []

    def variant(label: str, change, error, words, tensor=None, **kw) -> None:
        c = dict(b)
        change(c)
        path = tmp / f"{label}.safetensors"
        save_file(c, str(path))
        out.append((label, path, kw, error, words, path, tensor))

    down = "model.layers.0.mlp.down_proj.weight"
    variant("missing", lambda c: c.pop(down), DirectReloadError, "missing", down)
    variant(
        "extra",
        lambda c: c.update({"model.ghost.weight": torch.zeros(3)}),
        DirectReloadError,
        "unexpected",
        "model.ghost.weight",
    )
    variant(
        "shape",
        lambda c: c.update({"model.norm.weight": c["model.norm.weight"][:-1].clone()}),
        DirectReloadError,
        "shape",
        "model.norm.weight",
    )
    variant(
        "int-dtype",
        lambda c: c.update({down: c[down].to(torch.int32)}),
        DirectReloadError,
        "cannot be converted",
        down,
    )

    def nan(c):
        c[down] = c[down].clone()
        c[down][3, 4] = float("nan")

    def inf(c):
        c["lm_head.weight"] = c["lm_head.weight"].clone()
        c["lm_head.weight"][0, 0] = float("inf")

    variant("nan", nan, DirectReloadError, "1 NaN", down)
    variant("inf", inf, DirectReloadError, "1 Inf", "lm_head.weight")
    raw = src.read_bytes()

    def file(label: str, data: bytes, error, words) -> None:
        path = tmp / f"{label}.safetensors"
        path.write_bytes(data)
        out.append((label, path, {}, error, words, path, None))

    file("truncated", raw[: len(raw) - 100], CheckpointError, "truncated")
    file("corrupt-header", raw[:8] + b"{]" + raw[10:], CheckpointError, "corrupt header")
    file("oversized-header", struct.pack("<Q", 2**62) + raw[8:], CheckpointError, "exceeds")
    file("empty", b"", CheckpointError, "empty file")
    zipped = tmp / "torch-save.safetensors"
    torch.save({"evil": Evil(tmp / "PWNED"), **b}, zipped)
    out.append(("torch.save zip", zipped, {}, CheckpointError, "zip archive", zipped, None))
    file("pickle", pickle.dumps({"evil": Evil(tmp / "PWNED")}), CheckpointError, "pickle")
    other = build_tiny_model(tmp / "other", arch="qwen2", seed=5)
    out.append(("other model", other, {}, DirectReloadError, "unexpected", other, None))

    def sharded(label: str, shard_of_norm: str) -> Path:
        d = tmp / label
        d.mkdir()
        first = {k: v for k, v in b.items() if k != "model.norm.weight"}
        save_file(first, str(d / "part-1.safetensors"))
        save_file({"model.norm.weight": b["model.norm.weight"]}, str(d / "part-2.safetensors"))
        weight_map = dict.fromkeys(first, "part-1.safetensors")
        weight_map["model.norm.weight"] = shard_of_norm
        (d / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))
        return d

    evil = tmp / "evil.safetensors"
    save_file({"model.norm.weight": b["model.norm.weight"]}, str(evil))
    for label, name, words in [
        ("index-missing", "part-3.safetensors", "does not exist"),
        ("index-dotdot", "../evil.safetensors", "escapes"),
        ("index-absolute", str(evil), "escapes"),
        ("index-symlink", "link.safetensors", "escapes"),
    ]:
        d = sharded(label, name)
        if label == "index-symlink":
            (d / "link.safetensors").symlink_to(evil)
        out.append((label, d, {}, CheckpointError, words, d / INDEX_NAME, None))
    d = sharded("sharded-shape", "part-2.safetensors")
    save_file({"model.norm.weight": torch.ones(7)}, str(d / "part-2.safetensors"))
    out.append(
        ("sharded shape", d, {}, DirectReloadError, "part-2.safetensors", d, "model.norm.weight")
    )
    hashed = save_checkpoint(b, tmp / "hashed.safetensors").path
    data = bytearray(hashed.read_bytes())
    data[-7] ^= 0x10  # one bit in the data section
    hashed.write_bytes(bytes(data))
    kw = {"verify_hash": True}
    out.append(("hash", hashed, kw, CheckpointError, "content hash mismatch", hashed, None))
    return out


# -- a toy model for the direct-reload core (plain torch, no engine) ---------------------------


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 8, bias=False)
        self.other = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("scale", torch.ones(8))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) * self.scale
        h = torch.tanh(self.other(torch.tanh(h @ self.proj.weight.reshape(8, 8).t())))
        return self.head(h)


def toy_checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "emb.weight": torch.randn(16, 8, generator=g),
        "proj.weight": torch.randn(8, 8, generator=g),
        "other.weight": torch.randn(8, 8, generator=g),
        "other.bias": torch.randn(8, generator=g),
        "scale": torch.rand(8, generator=g) + 0.5,
    }


def load_by_name(model: nn.Module, ckpt: dict[str, torch.Tensor]) -> None:
    from weight_bridge.layout import live_tensors

    live = {name: t for name, t, _ in live_tensors(model)}
    with torch.no_grad():
        for name, t in ckpt.items():
            live[name].copy_(t)


def cold_start(ckpt: dict[str, torch.Tensor], process: Callable[[Toy], None]) -> Toy:
    """A fresh ``Toy`` loaded with ``ckpt``, its layout recorded, then ``process``ed: the
    reference every reload is judged against."""
    from weight_bridge.direct import record_checkpoint_layout

    model = Toy()
    load_by_name(model, ckpt)
    record_checkpoint_layout(model)
    process(model)
    return model


def snapshot_bytes(model: nn.Module) -> dict[int, bytes]:
    """Raw bytes of every storage, to prove a refused reload wrote nothing."""
    from weight_bridge.layout import live_tensors

    out = {}
    for _, t, _ in live_tensors(model):
        s = t.untyped_storage()
        out[s.data_ptr()] = bytes(torch.tensor([], dtype=torch.uint8).set_(s).numpy().tobytes())
    return out


A, B = toy_checkpoint(0), toy_checkpoint(1)
IDS = torch.arange(16)
