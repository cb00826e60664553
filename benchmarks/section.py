"""What every section run on its own does with its result (``python -m benchmarks.ranks``,
``python -m benchmarks.clients``): stamp it, write it with its markdown beside it, print the
markdown; or only redraw the markdown of a results file."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

__all__ = ["run_section"]


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def run_section(
    run: Callable[[], dict[str, Any]],
    render: Callable[[dict[str, Any]], str],
    out: Path | None,
    redraw: Path | None = None,
) -> dict[str, Any] | None:
    """``redraw``: write ``render`` of that results file to its ``.md`` (None returned). Else
    ``run()``'s result, stamped ``started`` and ``finished``, written to ``out`` (JSON) and
    ``out``'s ``.md``, its markdown printed."""
    if redraw is not None:
        redraw.with_suffix(".md").write_text(render(json.loads(redraw.read_text())))
        return None
    started = _now()
    result = run()
    result.update(started=started, finished=_now())
    text = render(result)
    if out is not None:
        out.write_text(json.dumps(result, indent=2) + "\n")
        out.with_suffix(".md").write_text(text)
    print(text)
    return result
