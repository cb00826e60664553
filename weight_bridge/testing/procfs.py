"""Reading ``/proc/<pid>/status`` (Linux only), for the soak and the benchmarks' memory probes."""

from __future__ import annotations

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
