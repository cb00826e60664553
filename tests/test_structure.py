"""The shape of the library, checked on its syntax trees (no import of the code itself).

* No import cycles among the modules of ``weight_bridge/`` and ``callbacks/``: each layer
  imports only the ones below it (imports inside functions count; a package's ``__init__``
  re-exporting its own modules does not).
* The engine side (what runs in vLLM's processes) reaches no trainer-side module, following
  what Python runs on import; the callback imports only the trainer side.
* No file of ``weight_bridge/`` or ``callbacks/`` over 600 lines, no function over 60. A file
  over 400 lines is a warning the review reads, not a failure: a module is split by concept,
  never to pass a count.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("weight_bridge", "callbacks")
MAX_FILE_LINES = 600
REVIEW_FILE_LINES = 400  # a warning: is this still one concept?
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str], fronts: bool = False) -> set[str]:
    """The modules of ``known`` that ``name`` imports; ``fronts``: what runs when it is
    imported (a package's ``__init__`` re-exporting its own modules counts; a name imported for
    the type checker only does not)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _nodes(ast.parse(path.read_text()), typing_only=not fronts):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base]) if base else ".".join(up)
            targets = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    if path.name == "__init__.py" and not fronts:  # re-exports are no design loop
        found = {t for t in found if not t.startswith(name + ".")}
    return found


def _nodes(tree: ast.AST, typing_only: bool) -> list[ast.AST]:
    """Every node of ``tree``; without ``typing_only``, not those of an ``if TYPE_CHECKING:``
    block (names for the type checker, never imported at run time)."""
    out, todo = [], [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if (
            not typing_only
            and isinstance(node, ast.If)
            and "TYPE_CHECKING" in ast.unparse(node.test)
        ):
            todo += node.orelse
            continue
        todo += ast.iter_child_nodes(node)
    return out


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_library_has_no_import_cycle() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, set(modules)) for name, path in modules.items()}
    assert import_cycles(graph) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    """The check itself can fail: a loop of three is found, a chain is not."""
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_files_and_functions_stay_small(package: str) -> None:
    long_files, long_functions = [], []
    for path in sorted((ROOT / package).rglob("*.py")):
        text = path.read_text()
        lines = text.count("\n")
        if lines > MAX_FILE_LINES:
            long_files.append(f"{path.relative_to(ROOT)}: {lines} lines")
        elif lines > REVIEW_FILE_LINES:
            warnings.warn(
                f"{path.relative_to(ROOT)}: {lines} lines: still one concept?", stacklevel=1
            )
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    where = f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
                    long_functions.append(f"{where}: {length} lines")
    assert not long_files, long_files
    assert not long_functions, long_functions


def _exception_classes() -> dict[str, tuple[str, list[str]]]:
    """Every class of the packages that derives (through the packages' own classes) from a
    built-in exception: name -> (where, its bases' names), ``where`` its dotted path."""
    import builtins

    classes: dict[str, tuple[str, list[str]]] = {}
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in node.bases]
                classes[node.name] = (f"{name}.{node.name}", bases)

    def is_exception(cls: str, seen: frozenset[str] = frozenset()) -> bool:
        builtin = getattr(builtins, cls, None)
        if isinstance(builtin, type) and issubclass(builtin, BaseException):
            return not issubclass(builtin, Warning)
        return (
            cls in classes
            and cls not in seen
            and any(is_exception(b, seen | {cls}) for b in classes[cls][1])
        )

    return {c: v for c, v in classes.items() if is_exception(c)}


# The test fixtures (``weight_bridge.testing``): their errors are theirs, not the library's.
FIXTURES = "weight_bridge.testing."
# Signals raised and caught inside the packages, which no caller ever sees (each is caught
# by name in the packages, checked below): not errors of the library.
SIGNALS = {"weight_bridge.sync.collective.StepFailed"}


def test_every_exception_derives_from_the_one_base() -> None:
    """``except WeightBridgeError`` catches every exception the library raises: each class
    derives from it (through the packages' own classes), and the public ones are named in the
    API doc. The test fixtures' errors are not the library's (none derives from it), and the
    few signals that never leave the packages are listed and caught."""
    classes = _exception_classes()
    assert len(classes) >= 15, sorted(classes)

    def derives(cls: str) -> bool:
        return cls == "WeightBridgeError" or any(
            derives(b) for b in classes.get(cls, ("", []))[1] if b in classes
        )

    fixtures = {c for c, (where, _) in classes.items() if where.startswith(FIXTURES)}
    signals = {c for c, (where, _) in classes.items() if where in SIGNALS}
    assert {classes[c][0] for c in signals} == SIGNALS  # each listed signal still exists
    library = {c: v for c, v in classes.items() if c not in fixtures | signals}
    assert [where for c, (where, _) in library.items() if not derives(c)] == []
    assert [classes[c][0] for c in fixtures | signals if derives(c)] == []
    caught = _caught_by_name()
    assert [classes[c][0] for c in signals if c not in caught] == []
    api = (ROOT / "docs" / "api.md").read_text()
    public = [c for c in library if not c.startswith("_") and c != "UpdateConflictError"]
    assert [c for c in public if f"`{c}`" not in api] == []


def _caught_by_name() -> set[str]:
    """Every exception name an ``except`` clause of the packages names."""
    caught: set[str] = set()
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ExceptHandler) and node.type is not None:
                types = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
                caught |= {t.id for t in types if isinstance(t, ast.Name)}
    return caught


# What runs inside vLLM's processes (the worker, the engine core, the API server, the
# internals), and the test fixtures: never imported by the callback layer.
NOT_TRAINER_SIDE = (
    "weight_bridge.vllm.worker",
    "weight_bridge.vllm.core",
    "weight_bridge.vllm.server",
    "weight_bridge.vllm.internals",
    "weight_bridge.testing",
)


def test_the_callbacks_use_only_the_trainer_side_of_the_library() -> None:
    """The callback layer runs in the trainer: it imports each library name from the front that
    exports it or from its defining module, never a private name, nothing that runs inside
    vLLM's processes and no test fixture."""
    wrong = []
    for path in sorted((ROOT / "callbacks").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                modules = [node.module] if node.module.startswith("weight_bridge") else []
                wrong += [
                    f"{path.name}: {node.module}.{a.name}"
                    for a in node.names
                    if modules and a.name.startswith("_")
                ]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            else:
                continue
            wrong += [f"{path.name}: {m}" for m in modules if m.startswith(NOT_TRAINER_SIDE)]
    assert wrong == []


def test_the_library_calls_nothing_of_the_callbacks() -> None:
    """Issue 63: the library is a layer below the callback: no module of ``weight_bridge``
    imports ``callbacks`` (a function's import, or one for the type checker, included), so the
    sync it runs calls nothing back up into the callback's code."""
    modules = _modules()
    known = set(modules)
    wrong = {
        name: sorted(t for t in _imports(name, path, known) if t.startswith("callbacks"))
        for name, path in modules.items()
        if name.startswith("weight_bridge")
    }
    assert {name: up for name, up in wrong.items() if up} == {}


# The trainer side of a sync: what runs only in the trainer (the callback, the sync policy, the
# delta policy). The engine's own code (``ENGINE_SIDE``) reaches none of it, however indirectly.
TRAINER_SIDE = ("callbacks", "weight_bridge.sync")
TRAINER_DELTA_POLICY = tuple(
    f"weight_bridge.delta.{m}" for m in ("choice", "keyframes", "reference", "sink", "state")
)
ENGINE_SIDE = (
    "weight_bridge.direct",
    "weight_bridge.vllm.worker",
    "weight_bridge.vllm.core",
    "weight_bridge.vllm.server",
    "weight_bridge.vllm.plugin",
)


def _reached(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _package_fronts(name: str, modules: set[str]) -> set[str]:
    """The packages whose ``__init__`` runs when ``name`` is imported."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))} & modules


def test_the_engine_side_reaches_no_trainer_side_module() -> None:
    """What runs in vLLM's processes imports nothing of the trainer's sync: following every
    import (a package's ``__init__`` included, as Python runs it), no engine-side module reaches
    the callback, :mod:`weight_bridge.sync` or the delta policy (the delta *format* it reads)."""
    modules = _modules()
    known = set(modules)
    graph = {
        name: _imports(name, path, known, fronts=True) | _package_fronts(name, known)
        for name, path in modules.items()
    }
    wrong = {
        (name, reached)
        for name in modules
        if name.startswith(ENGINE_SIDE)
        for reached in _reached(graph, name)
        if reached.startswith(TRAINER_SIDE + TRAINER_DELTA_POLICY)
    }
    assert sorted(wrong) == []
