"""Reading ``/proc`` (Linux only), for the soak, the benchmarks' memory probes and the tools."""

from __future__ import annotations

import glob
from collections.abc import Collection


def proc_status_fields(pid: int | str, keys: Collection[str]) -> dict[str, int]:
    """The number of each ``keys`` line of ``/proc/<pid>/status``, in the file's order.

    As the kernel writes it: kB for memory (``VmRSS``, ``RssAnon``, ...), a count for
    ``Threads``. Raises ``OSError`` if the process is gone.
    """
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in keys:
                out[key] = int(rest.split()[0])
    return out


def descendants(root: int) -> list[int]:
    """The pids of every descendant of process ``root``, sorted."""
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
        children.setdefault(ppid, []).append(int(stat.split("/")[2]))
    out, todo = [], [root]
    while todo:
        out += (found := children.get(todo.pop(), []))
        todo += found
    return sorted(out)
