"""The top level exports the product, and every engine is the one client.

* ``import weight_bridge`` and ``import callbacks`` (and the stdlib-only HTTP client) need no
  vLLM: a trainer that pushes into a server installs none.
* Every name of ``weight_bridge.__all__`` resolves (the vLLM ones on first use).
* The README's examples import the library from at most three modules (fixtures of
  ``weight_bridge.testing`` aside): the product, the callbacks, and ``vllm`` itself.
* Every client and every engine the library starts is a
  :class:`~weight_bridge.vllm.clients.bridge_client.BridgeClient` with nothing
  left abstract: one push routine, one served chain, one report.
* The face is small: ``__all__`` on the package fronts only, at most 80 names over all of
  them (the internals export nothing), a user's (``weight_bridge`` and ``callbacks``) at most 40.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_top_level_and_the_callback_import_without_vllm() -> None:
    code = (
        "import sys, weight_bridge, callbacks\n"
        "from weight_bridge import HTTPClient, EngineClient, save_checkpoint, CheckpointReader\n"
        "from weight_bridge import DirectReloadError, CheckpointError\n"
        "assert 'vllm' not in sys.modules, sorted(m for m in sys.modules if 'vllm' in m)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_every_exported_name_resolves() -> None:
    import weight_bridge
    import weight_bridge.vllm

    for module in (weight_bridge, weight_bridge.vllm):
        for name in module.__all__:
            assert getattr(module, name) is not None, name
    with pytest.raises(AttributeError):
        _ = weight_bridge.direct_reload  # the direct-reload machinery lives in .direct


def test_the_readme_reads_in_five_minutes() -> None:
    """At most 200 lines: the two commands, the quick start first, a short section per entry
    point; the depth lives in docs/."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, len(lines)
    assert lines[2].startswith("- **Run the main job**") and "make demo" in lines[2]
    assert lines[3].startswith("- **Run the tests**") and "make test" in lines[3]
    assert [x for x in lines if x.startswith("## ")][0] == "## Quick start: a Lightning callback"


KNOB_LIMIT = 24


def _callback_knobs() -> list[str]:
    """Every knob a callback user can set: the callback's arguments, each option group counted
    by its fields (an ``engine`` given as a client or a spec is one knob: the spec's fields), a
    group's field holding a group (``EngineSpec.options``) by that group's fields, and every
    environment variable the callback layer reads."""
    import dataclasses
    import inspect

    import callbacks as cb

    groups = {
        "engine": cb.EngineSpec,
        "schedule": cb.Schedule,
        "files": cb.CheckpointFiles,
        "names": cb.CheckpointNames,
        "canary": cb.CanaryCheck,
    }
    params = [p for p in inspect.signature(cb.VLLMWeightSync.__init__).parameters if p != "self"]
    assert set(groups) <= set(params)
    knobs = []
    for param in params:
        group = groups.get(param)
        if group is None:
            knobs.append(param)
            continue
        for f in dataclasses.fields(group):
            inner = f.default_factory  # a group in the group (EngineSpec.options): its fields
            subs = dataclasses.fields(inner) if dataclasses.is_dataclass(inner) else ()
            knobs += [f"{param}.{f.name}.{g.name}" for g in subs] or [f"{param}.{f.name}"]
    for path in sorted((ROOT / "callbacks").rglob("*.py")):  # os.environ, os.getenv
        lines = path.read_text().splitlines()
        knobs += [
            f"${path.name}:{i}" for i, x in enumerate(lines, 1) if "environ" in x or "getenv" in x
        ]
    return knobs


def test_a_callback_user_has_at_most_twenty_four_knobs() -> None:
    """Twenty-four or fewer, the engine's typed options included (``enabled`` is the per-run
    switch: a config flag, no environment variable beside it). Of ``engine.options``,
    ``bridge`` is the bridge's update options (``BridgeOptions``, documented there) and
    ``engine_args`` vLLM's engine arguments, passed through: one knob each."""
    knobs = _callback_knobs()
    assert len(knobs) <= KNOB_LIMIT, knobs
    assert {"engine.options.inflight", "engine.options.kv_cache_gb"} <= set(knobs), knobs
    assert len(knobs) == len(set(knobs)) and not [k for k in knobs if k.startswith("$")], knobs


def test_the_readme_imports_from_at_most_three_modules() -> None:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    modules = {
        m
        for block in blocks
        for m in re.findall(r"^from (\S+) import", block, re.M)
        if (m.split(".")[0] in {"weight_bridge", "callbacks", "vllm"})
        and not m.startswith("weight_bridge.testing")
    }
    assert len(modules) <= 3, sorted(modules)


@pytest.mark.parametrize(
    "where",
    [
        "weight_bridge.vllm.clients.llm:LLMClient",
        "weight_bridge.vllm.clients.async_llm:AsyncLLMClient",
        "weight_bridge.vllm.clients.http:HTTPClient",
        "weight_bridge.vllm.clients.colocated:ColocatedEngine",
        "weight_bridge.vllm.clients.async_colocated:AsyncColocatedEngine",
        "weight_bridge.vllm.clients.served:ServedEngine",
    ],
)
def test_every_engine_is_the_one_client(where: str) -> None:
    import importlib

    from weight_bridge.vllm.clients.bridge_client import BridgeClient

    module, _, name = where.partition(":")
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, BridgeClient) and not cls.__abstractmethods__
    for method in ("push", "push_async", "generate", "submit", "close"):
        assert callable(getattr(cls, method)), method
    assert isinstance(cls.served_checkpoints, property)


def test_a_push_into_a_server_without_the_results_route_is_refused_naming_the_flag(
    tmp_path: Path,
) -> None:
    """A server started by hand without the bridge's middleware: nothing is sent but the
    probe. (A stdlib server that answers 404 to every route stands in for it: a real ``vllm
    serve`` would answer the same for the missing route, at the cost of a start.)"""
    import http.server
    import threading

    from weight_bridge import HTTPClient, RemoteUpdateError

    seen: list[str] = []

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            seen.append(f"GET {self.path}")
            self.send_error(404)

        do_POST = do_GET  # noqa: N815

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = HTTPClient(f"http://127.0.0.1:{server.server_address[1]}")
        with pytest.raises(RemoteUpdateError, match="update_results_route") as refused:
            client.push(tmp_path / "w.safetensors", version="1")
        assert refused.value.status == 404 and "nothing was pushed" in refused.value.message
        assert seen == ["GET /weight_bridge/results"]
    finally:
        server.shutdown()


def test_one_function_makes_the_same_typed_error_of_a_report_on_either_side_of_a_boundary() -> None:
    """The engine core's report, as built and after a JSON round trip (the results route):
    :func:`typed_error` makes the same type, message and ``.problems`` of both, every rank's
    problems merged, the report attached; a success makes none, and its figures are the
    same on both sides."""
    import json

    from weight_bridge.checkpoint import CheckpointError
    from weight_bridge.direct import DirectReloadError
    from weight_bridge.vllm.outcome import PushFailure, PushResult
    from weight_bridge.vllm.report import PushReport, report_of, typed_error

    def refused(rank: int, kind: str, problems: dict[str, str], message: str) -> PushResult:
        error = PushFailure(kind, message, problems, "refused", "/r/x")
        return PushResult(rank=rank, checkpoint="/r/x", error=error)

    def crossed(report: PushReport) -> PushReport | None:
        return PushReport.from_dict(json.loads(json.dumps(report.to_dict())))

    cases = {
        DirectReloadError: [
            refused(0, "DirectReloadError", {"a.weight": "shape (3,), recorded (4,)"}, "refused"),
            refused(1, "DirectReloadError", {"b.weight": "NaN"}, "refused"),
        ],
        CheckpointError: [refused(0, "CheckpointError", {"a.weight": "truncated"}, "truncated")],
    }
    for kind, results in cases.items():
        report = PushReport.of(results, None, "refused", None)
        here = typed_error(report)
        there = typed_error(crossed(report))
        assert type(here) is type(there) is kind and str(here) == str(there)
        assert here.problems == there.problems  # type: ignore[union-attr]
        merged = {k: v for r in results if r.error for k, v in r.error.problems.items()}
        assert there.problems == merged  # type: ignore[union-attr]
        assert report_of(there) is not None and report_of(there).failed == "refused"  # type: ignore[union-attr]
    done = PushReport.of([PushResult(checkpoint="/r/y", mode="delta")], "v1")
    assert typed_error(done) is None and typed_error(None) is None
    assert crossed(done) == done


FRONTS_LIMIT = 80  # the names every package front exports, all together
USER_FACE_LIMIT = 40  # what a user imports: ``weight_bridge`` and ``callbacks`` together
INTERNALS = "weight_bridge/vllm/internals/__init__.py"


def _declared_all(path: Path) -> list[str] | None:
    """The names a module's ``__all__`` lists, read from its syntax tree (None: it has none)."""
    import ast

    names = None
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            names = [*(names or []), *ast.literal_eval(node.value or ast.List([]))]
    return names


def test_the_face_is_small() -> None:
    """``__all__`` only on the package fronts (``__init__.py``), at most 80 names over all of
    them, the internals exporting nothing (no ``__all__``, no import); what a user imports
    (``weight_bridge`` and ``callbacks``) at most 40 names, each documented in docs/api.md."""
    import ast

    import callbacks
    import weight_bridge

    fronts, inner = {}, []
    for package in ("weight_bridge", "callbacks"):
        for path in sorted((ROOT / package).rglob("*.py")):
            names = _declared_all(path)
            where = str(path.relative_to(ROOT))
            if names is not None and path.name == "__init__.py":
                fronts[where] = names
            elif names is not None:
                inner.append(where)
    assert inner == []
    assert sum(map(len, fronts.values())) <= FRONTS_LIMIT, {k: len(v) for k, v in fronts.items()}
    internals = ast.parse((ROOT / INTERNALS).read_text()).body
    assert INTERNALS not in fronts
    assert [n for n in internals if isinstance(n, (ast.Import, ast.ImportFrom))] == []
    user = [*weight_bridge.__all__, *callbacks.__all__]
    assert len(user) <= USER_FACE_LIMIT, user
    api = (ROOT / "docs" / "api.md").read_text()
    assert [name for name in user if not re.search(rf"`{name}[`(]", api)] == []
