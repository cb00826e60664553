"""The one place that touches vLLM's internals (``weight_bridge/vllm/internals/``), without
an engine: every site it names exists in the installed vLLM, a missing one is named before
anything is patched, a vLLM other than the tested ones is refused (or let through by the opt-in),
and no other module of the library assigns onto a vLLM object."""

from __future__ import annotations

import ast
import importlib
import logging
from pathlib import Path
from typing import cast

import pytest

from weight_bridge.vllm.internals.patches import PATCHED, patch_rl_api
from weight_bridge.vllm.internals.sites import SITES, SITES_BY_VERSION, sites
from weight_bridge.vllm.internals.versions import (
    ALLOW_UNTESTED_ENV,
    TESTED_VLLM,
    UntestedVLLMError,
    check_vllm_version,
    vllm_minor,
)

pytestmark = pytest.mark.every_vllm  # each vLLM's own sites, checked on it

ROOT = Path(__file__).resolve().parents[1]
INTERNALS = ROOT / "weight_bridge" / "vllm" / "internals"
# Models and plugins built for the tests: they set attributes on their own modules.
NOT_LIBRARY = ROOT / "weight_bridge" / "testing"


def _resolve(path: str) -> object:
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ModuleNotFoundError(path)


@pytest.mark.parametrize("site", sites())
def test_every_site_exists_in_the_installed_vllm(site: str) -> None:
    """The sites of the installed vLLM's minor version: the shared ones and its own."""
    _resolve(site)


def test_every_tested_version_has_its_checklist() -> None:
    """Each tested minor version lists its own sites, and the installed vLLM is one of them."""
    assert set(SITES_BY_VERSION) == set(TESTED_VLLM)
    major, minor = vllm_minor()
    assert f"{major}.{minor}" in TESTED_VLLM
    other = [v for v in TESTED_VLLM if v != f"{major}.{minor}"]
    assert set(sites()) != set(sites(f"{other[0]}.0"))


def test_every_patched_site_is_a_site() -> None:
    assert set(PATCHED) <= set(SITES)
    assert len(set(SITES)) == len(SITES)


def test_a_missing_site_is_named_and_nothing_is_patched(monkeypatch) -> None:
    from vllm.entrypoints.rl.offline import RLOfflineMixin
    from vllm.v1.engine.async_llm import AsyncLLM

    before = AsyncLLM.update_weights
    monkeypatch.delattr(RLOfflineMixin, "start_weight_update")
    with pytest.raises(RuntimeError) as raised:
        patch_rl_api(*[lambda original: original] * 4)
    assert str(raised.value) == (
        "vllm.entrypoints.rl.offline.RLOfflineMixin.start_weight_update is missing: weight-bridge "
        "supports vLLM 0.32 and 0.34 (see weight_bridge/vllm/internals/__init__.py's checklist)"
    )
    assert AsyncLLM.update_weights is before


@pytest.mark.parametrize("version", ["0.32.0", "0.34.0", "0.34.2"])
def test_a_tested_vllm_passes_silently(monkeypatch, caplog, version) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", version)
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    with caplog.at_level(logging.WARNING):
        assert check_vllm_version() == version
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("version", ["0.33.1", "0.35.0", "1.0.0"])
def test_an_untested_vllm_is_refused_unless_opted_in(monkeypatch, caplog, version) -> None:
    """Refused naming the checklist and the opt-in; with the opt-in, one warning."""
    import vllm

    monkeypatch.setattr(vllm, "__version__", version)
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(UntestedVLLMError) as raised:
        check_vllm_version()
    message = str(raised.value)
    assert f"vLLM {version}" in message and "internals/__init__.py" in message
    assert f"{ALLOW_UNTESTED_ENV}=1" in message
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    with caplog.at_level(logging.WARNING):
        assert check_vllm_version() == version
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"vLLM {version}" in warnings[0]


def test_a_bridged_engine_is_not_started_on_an_untested_vllm(monkeypatch, tmp_path) -> None:
    """The refusal comes before any engine starts (the worker's backend refuses too)."""
    import vllm

    from weight_bridge import ColocatedEngine

    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(UntestedVLLMError, match="vLLM 0.35.0"):
        ColocatedEngine(tmp_path, checkpoint_root=str(tmp_path))


def assignments_onto_vllm(source: str) -> list[str]:
    """Where ``source`` assigns (or deletes) an attribute of a name imported from vLLM, or
    calls ``setattr`` / ``delattr`` at all."""
    tree = ast.parse(source)
    from_vllm: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            from_vllm |= {
                (a.asname or a.name).split(".")[0]
                for a in node.names
                if a.name.split(".")[0] == "vllm"
            }
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            from_vllm |= {a.asname or a.name for a in node.names}
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
        ):
            found.append(f"line {node.lineno}: {node.func.id}(...)")
        for target in targets:
            root = target
            while isinstance(root, ast.Attribute | ast.Subscript):
                root = root.value
            named = isinstance(root, ast.Name) and root.id in from_vllm
            if isinstance(target, ast.Attribute) and named:
                found.append(f"line {node.lineno}: {ast.unparse(target)}")
    return found


def test_only_vllm_internals_assigns_onto_vllm() -> None:
    offenders = []
    for path in sorted((ROOT / "weight_bridge").rglob("*.py")):
        if path.is_relative_to(INTERNALS) or path.is_relative_to(NOT_LIBRARY):
            continue
        offenders += [
            f"{path.relative_to(ROOT)} {f}" for f in assignments_onto_vllm(path.read_text())
        ]
    assert not offenders, offenders


# vLLM's own objects by the names the bridge gives them (a parameter of a wrapper, a loop
# variable, a local): an attribute written on one of them is an instance write into vLLM.
VLLM_OBJECTS = frozenset(
    {"core", "engine_core", "llm", "worker", "scheduler", "request", "output", "out"}
    | {"layer", "runner", "condition"}
)
# Attributes of vLLM objects that are vLLM's internals, not its API: read only in internals/.
VLLM_INTERNAL_ATTRS = frozenset(
    {"llm_engine", "engine_core", "engine_client", "model_runner", "model_executor"}
    | {"scheduler", "busy_loop_s", "response_mqs", "vllm_config", "resources"}
    | {"utility_results", "outputs_queue", "weight_transfer_engine", "kv_cache_manager"}
)
OWN_PRIVATE_ROOTS = frozenset({"self", "cls", "os", "sys"})  # os._exit: the standard library


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _vllm_self(name: ast.Name, parents: dict[ast.AST, ast.AST]) -> bool:
    """``self`` of a function that is not a method of a class of this file: the vLLM object
    whose method the function wraps."""
    node: ast.AST | None = name
    while node is not None and not (
        isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and any(a.arg == "self" for a in node.args.args)
    ):
        node = parents.get(node)  # a closure's ``self`` is the enclosing function's
    return node is not None and not isinstance(parents.get(node), ast.ClassDef)


def vllm_object_access(source: str) -> list[str]:
    """Where ``source`` writes into a vLLM object's instance (an attribute of a vLLM object by
    its name, of a wrapper's ``self``; its ``__dict__`` or ``vars()``) or reads vLLM's private
    state (an underscore attribute of anything but ``self``, one of
    :data:`VLLM_INTERNAL_ATTRS`, an underscore name imported from vLLM)."""
    tree = ast.parse(source)
    parents = _parents(tree)
    found = []
    for node in ast.walk(tree):
        where = f"line {getattr(node, 'lineno', 0)}: "
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm"):
            found += [where + a.name for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "vars":
                found.append(where + ast.unparse(node))
        elif isinstance(node, ast.Attribute):
            root = node.value
            while isinstance(root, ast.Attribute | ast.Subscript | ast.Call):
                root = root.func if isinstance(root, ast.Call) else root.value
            rooted = root.id if isinstance(root, ast.Name) else ""
            private = node.attr.startswith("_") and not node.attr.endswith("__")
            internal = node.attr == "__dict__" or node.attr in VLLM_INTERNAL_ATTRS
            foreign = private and rooted not in OWN_PRIVATE_ROOTS and rooted != "super"
            written = isinstance(node.ctx, ast.Store | ast.Del) and (
                rooted in VLLM_OBJECTS
                or (rooted == "self" and _vllm_self(cast(ast.Name, root), parents))
            )
            if internal or foreign or written:
                found.append(where + ast.unparse(node))
    return found


def test_only_internals_touches_vllm_objects() -> None:
    """Outside internals/, the vLLM layer neither writes into vLLM's instances nor reads its
    private state (the assignment scan above covers classes and modules everywhere)."""
    offenders = []
    for path in sorted((ROOT / "weight_bridge" / "vllm").rglob("*.py")):
        if not path.is_relative_to(INTERNALS):
            found = vllm_object_access(path.read_text())
            offenders += [f"{path.relative_to(ROOT)} {f}" for f in found]
    assert not offenders, offenders


def test_the_instance_scan_finds_each_kind() -> None:
    """The instance scan can fail: a planted write or private read of each kind is found;
    the project's own objects are not."""
    planted = {
        "def f(core):\n    core.__dict__['x'] = 1": 1,
        "def f(out):\n    vars(out)['policy_version'] = 1": 1,
        "def f(llm):\n    llm.policy_version = 1": 1,
        "def wrap(original):\n    def g(self):\n        self.busy_loop_s = 0\n    return g": 1,
        "def f(llm):\n    return llm.llm_engine": 1,
        "def f(x):\n    return x._weight_version": 1,
        "from vllm.v1.engine.core import _private": 1,
        "class A:\n    def f(self, report):\n        self._x = report._y = 1": 1,
        "class A:\n    def f(self, report):\n        self._x = 1\n        report.y = super()._z": 0,
        "class A:\n    def f(self):\n        def g():\n            self.used = True": 0,
    }
    for source, count in planted.items():
        assert len(vllm_object_access(source)) == count, (source, vllm_object_access(source))


def test_the_assignment_scan_finds_each_kind() -> None:
    """The scan itself can fail: each way of patching vLLM is found, plain code is not."""
    patches = {
        "from vllm.v1.engine import core\ncore.EngineCore.collective_rpc = f": 1,
        "import vllm.v1.engine.core as c\nc.EngineCore.x += 1": 1,
        "from vllm.x import Y\ndel Y.z": 1,
        "import vllm\nvllm.v1.engine.core.EngineCore.x = 1": 1,
        "setattr(anything, 'x', 1)": 1,
        "from vllm import LLM\nllm = LLM('m')\nself.llm = llm\nd = {}\nd['k'] = 1": 0,
    }
    for source, count in patches.items():
        assert len(assignments_onto_vllm(source)) == count, source
