"""The test suite's own layout: shared helpers live in ``tests/helpers.py``, so no file under
``tests/`` imports a test module (``test_*``) or ``conftest``, and none edits ``sys.path``
(pytest's default import mode puts ``tests/`` on it; a script run as ``python tests/x.py`` has
it as ``sys.path[0]``)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.ImportFrom):  # relative: ``from . import test_x``
            out += [(node.lineno, alias.name) for alias in node.names]
    return out


def _sys_path_edits(tree: ast.AST) -> list[int]:
    """Lines calling a method of ``sys.path`` (``insert``, ``append``, ``extend``, ...)."""
    lines = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value
        if (
            isinstance(owner, ast.Attribute)
            and owner.attr == "path"
            and isinstance(owner.value, ast.Name)
            and owner.value.id == "sys"
        ):
            lines.append(node.lineno)
    return lines


def layout_problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = [
        (line, f"imports {module} (use helpers.py)")
        for line, module in _imported_modules(tree)
        if module.split(".")[0].startswith("test_") or module.split(".")[0] == "conftest"
    ]
    found += [(line, "edits sys.path") for line in _sys_path_edits(tree)]
    return [f"{path.name}:{line} {what}" for line, what in sorted(found)]


def test_no_test_imports_another_test_module_or_edits_sys_path() -> None:
    files = sorted(TESTS.glob("*.py"))
    assert TESTS / "helpers.py" in files and len(files) > 10
    problems = [p for f in files for p in layout_problems(f)]
    assert not problems, "\n".join(problems)


def test_the_check_catches_each_kind(tmp_path: Path) -> None:
    """Control: each forbidden form is reported, so a clean run above means something."""
    bad = tmp_path / "test_bad.py"
    bad.write_text(
        "import sys\n"
        "from test_direct import Toy\n"
        "import test_engine as e\n"
        "from conftest import greedy\n"
        "def f():\n"
        "    from test_callback import trainer\n"
        "    sys.path.insert(0, 'x')\n"
        "sys.path.append('y')\n"
        "from helpers import greedy\n"
        "import testing_tools\n"
    )
    got = layout_problems(bad)
    assert got == [
        "test_bad.py:2 imports test_direct (use helpers.py)",
        "test_bad.py:3 imports test_engine (use helpers.py)",
        "test_bad.py:4 imports conftest (use helpers.py)",
        "test_bad.py:6 imports test_callback (use helpers.py)",
        "test_bad.py:7 edits sys.path",
        "test_bad.py:8 edits sys.path",
    ], got
