"""Saving: save_checkpoint against a raw fsynced write of the same bytes."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .machine import fs_type
from .stats import Rounds


def _bytes_view(t: Any) -> memoryview:
    import torch

    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def bench_save(src_file: Path, dirs: dict[str, Path], reps: int) -> dict[str, Any]:
    """save_checkpoint vs a raw fsynced write of the same bytes, per directory."""
    from weight_bridge.checkpoint import CheckpointReader, save_checkpoint

    with CheckpointReader(src_file) as reader:
        tensors = {name: t.clone() for name, t in reader.tensors()}
    total = sum(t.nbytes for t in tensors.values())

    def raw_write(path: Path) -> float:
        t0 = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            for t in tensors.values():
                view = _bytes_view(t)
                while view:
                    n = f.write(view)
                    view = view[n:]
            os.fsync(f.fileno())
        return time.perf_counter() - t0

    def save(path: Path) -> float:
        t0 = time.perf_counter()
        save_checkpoint(tensors, path, metadata={"format": "pt"}, fsync=True)
        return time.perf_counter() - t0

    def hash_only() -> float:
        import blake3

        t0 = time.perf_counter()
        h = blake3.blake3(max_threads=blake3.blake3.AUTO)
        for t in tensors.values():
            h.update(_bytes_view(t))
        h.hexdigest()
        return time.perf_counter() - t0

    out: dict[str, Any] = {
        "bytes": total,
        "what": (
            "save_checkpoint(fsync=True): blake3 hash + header + data to a temp file, fsync, "
            "rename; raw: the same tensor bytes written to a file in the same directory "
            "(unbuffered), fsync; files deleted after each rep"
        ),
    }
    for label, d in dirs.items():
        d.mkdir(parents=True, exist_ok=True)
        rounds = Rounds()
        target = d / "bench_save.safetensors"
        raw = d / "bench_raw.bin"

        def run_save(rep: int, target: Path = target) -> float:
            try:
                return save(target)
            finally:
                target.unlink(missing_ok=True)

        def run_raw(rep: int, raw: Path = raw) -> float:
            try:
                return raw_write(raw)
            finally:
                raw.unlink(missing_ok=True)

        methods: dict[str, Callable[[int], Any]] = {
            "save_checkpoint": run_save,
            "raw_write": run_raw,
        }
        if label == "disk":
            methods["hash_only"] = lambda rep: hash_only()
        rounds.run(methods, reps)
        out[label] = {"dir": str(d), "fs": fs_type(d)}
        for name in methods:
            out[label][name] = rounds.result(name)
    return out
