"""Every name the documentation points at exists (issue 63.6): a renamed module, class or
function leaves no reference behind it.

Read from the syntax trees and the files (no engine starts); an installed package's source is
read the same way, and only a name that the source cannot show (a C extension, a module's
``__getattr__``, a class with a base from elsewhere) is looked up by importing it: ``torch``
alone, today, in a few seconds.

**Docstrings and comments** of ``weight_bridge/`` and ``callbacks/`` (every string of a
module, docstrings first of all, and every comment): each ``:class:``, ``:func:``, ``:meth:``,
``:mod:``, ``:data:``, ``:attr:``, ``:exc:`` or ``:obj:`` reference (``~`` or ``!`` in front, a
``title <target>`` form, a target wrapped over two lines: all read as the bare target) resolves:

* ``a.b.c`` from the top (``weight_bridge``, ``callbacks``, ``vllm``, ``torch``, ``re``...): the
  longest prefix that is a module, then attribute by attribute (a class's own members, ``self.x``
  assignments and its bases' members; a package's submodules; ``import`` and ``from . import``
  followed to where the name is defined);
* ``.x.y``: as the same dots would in a ``from`` import in that module (``.undo.HostStore`` in
  ``weight_bridge.direct.session`` is ``weight_bridge.direct.undo.HostStore``), or else within the
  module itself (and its class);
* a bare ``Name`` or ``Name.attr``: in the class whose docstring (or whose method's) holds it,
  the classes and functions around that, the module's own names, then the builtins.

**docs/*.md and README.md** (inline code spans, the lines of fenced blocks, Markdown links):

* a ``*.py`` path (``weight_bridge/vllm/worker/transaction.py``, ``trust.py``,
  ``core/updates.py``) is a file from the repository root, or else the tail of one or more files
  of the repository (whole path components: ``clients/llm.py`` is
  ``weight_bridge/vllm/clients/llm.py``), or else a file of the installed package its first
  component names (``vllm/entrypoints/...``); ``tests/x.py::test_y[...]`` also names a test of
  that file;
* another path (``bench/results.json``, ``docs/``, ``weight_bridge/vllm/worker/``) is checked
  where its first component is a directory of the repository root, the same way;
* a Markdown link to a file (``[x](design.md#anchor)``) names a file beside the document;
* a dotted name (``weight_bridge.vllm.clients.by_name``, ``weight_bridge.vllm.plugin:register``,
  ``torch.nn.Module``) whose first component is a module of the repository or an installed one
  resolves as a docstring's does from the top (``__main__.X``: in a ``__main__.py`` of the
  repository); ``Name.attr`` where some class of the library is ``Name`` resolves in one such
  class; a short form (``outcome.typed_error``, ``internals.patches.patch_engine_core``)
  resolves below a module of ``weight_bridge``/``callbacks`` whose dotted name ends so. A short
  form that does not is a stale module path where it leads to a class of the library, or ends
  in a function or class defined at a module's top (``engines.start_engine``,
  ``client.BridgeClient.push_async``), unless it is ``x.y`` with ``y`` an attribute some class
  of the library has (``report.served``, ``engine.fingerprints()``: a variable's attribute).
  Not checked: the string of a key or an entry point that the library or ``pyproject.toml``
  spells out (``weight_bridge.delta`` is a metadata key, ``vllm.general_plugins`` an
  entry-point group), other classes' attributes (``LLM.generate``), other variables'
  (``trainer.fit``), and bare single words.

Every reference that does not resolve is listed, with its file and line, in one failure; the
last test plants a stale name of each kind and checks that it is caught.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import io
import os
import re
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("weight_bridge", "callbacks")
SKIP_DIRS = {"__pycache__", "build", "dist", "weight_bridge.egg-info"}
ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):`([^`]+)`")


# --- a static index of Python source: what each module and class defines, and where from ----


@dataclass(eq=False)
class Space:
    """A module, class or function: the names it binds (``"ns"``: a nested space, ``"ref"``: the
    dotted name it was imported from, ``"value"``: anything else), its bases (a class) or its
    ``import *`` sources (a module), and whether its source is this repository's."""

    module: str
    kind: str  # "module", "class", "function" or "opaque" (a C extension, a builtin module)
    ours: bool
    names: dict[str, tuple[str, object]] = field(default_factory=dict)
    bases: list[str] = field(default_factory=list)
    stars: list[str] = field(default_factory=list)
    is_package: bool = False
    qualname: str = ""  # within its module


Found = tuple["bool | None", "Space | None"]  # exists (None: the source cannot say), its space


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else None
    if isinstance(node, ast.Subscript):  # Generic[T]
        return _dotted(node.value)
    return None


def _targets(node: ast.AST) -> Iterator[str]:
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, (ast.Tuple, ast.List, ast.Starred)):
        for element in node.elts if not isinstance(node, ast.Starred) else [node.value]:
            yield from _targets(element)


def _absolute(package: str, level: int, module: str | None) -> str:
    if not level:
        return module or ""
    up = package.split(".")[: len(package.split(".")) - level + 1]
    return ".".join([*up, module] if module else up)


def _bind_import(space: Space, node: ast.Import | ast.ImportFrom, package: str) -> None:
    if isinstance(node, ast.Import):
        for alias in node.names:
            top = alias.name.split(".")[0]
            space.names[alias.asname or top] = ("ref", alias.name if alias.asname else top)
        return
    base = _absolute(package, node.level, node.module)
    for alias in node.names:
        if alias.name == "*":
            space.stars.append(base)
        else:
            space.names[alias.asname or alias.name] = ("ref", f"{base}.{alias.name}")


BLOCKS = (ast.If, ast.Try, ast.With, ast.AsyncWith, ast.For, ast.AsyncFor, ast.While)


def _fill(space: Space, body: list[ast.stmt], package: str) -> None:
    """The names ``body`` binds (into ``if``/``try``/``with``/``for`` blocks, not into defs)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            space.names[node.name] = ("ns", _space_of(node, space, package))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            _bind_import(space, node, package)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for name in (n for t in targets for n in _targets(t)):
                space.names.setdefault(name, ("value", None))
        if isinstance(node, BLOCKS) or type(node).__name__ == "TryStar":
            for block in ("body", "orelse", "finalbody"):
                _fill(space, getattr(node, block, []), package)
            for handler in getattr(node, "handlers", []):
                _fill(space, handler.body, package)


def _self_attributes(node: ast.ClassDef) -> Iterator[str]:
    """``self.x = ...`` in any method, ``setattr(self, "x", ...)``, and ``__slots__``."""
    for inner in ast.walk(node):
        if isinstance(inner, ast.Attribute) and isinstance(inner.ctx, ast.Store):
            if _dotted(inner.value) == "self":
                yield inner.attr
        elif isinstance(inner, ast.Call) and _dotted(inner.func) in SETATTR and inner.args[1:]:
            if isinstance(inner.args[1], ast.Constant):
                yield str(inner.args[1].value)
        elif isinstance(inner, ast.Assign) and "__slots__" in _targets_of(inner):
            for const in ast.walk(inner.value):
                if isinstance(const, ast.Constant) and isinstance(const.value, str):
                    yield const.value


def _targets_of(node: ast.Assign) -> list[str]:
    return [name for target in node.targets for name in _targets(target)]


SETATTR = ("setattr", "object.__setattr__")


def _space_of(
    node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef, outer: Space, package: str
) -> Space:
    kind = "class" if isinstance(node, ast.ClassDef) else "function"
    qualname = f"{outer.qualname}.{node.name}" if outer.qualname else node.name
    space = Space(module=outer.module, kind=kind, ours=outer.ours, qualname=qualname)
    _fill(space, getattr(node, "body", []), package)
    if isinstance(node, ast.ClassDef):
        space.bases = [b for b in map(_dotted, node.bases) if b]
        for name in _self_attributes(node):
            space.names.setdefault(name, ("value", None))
    return space


def _ours(path: Path) -> bool:
    return path.is_relative_to(ROOT) and not path.relative_to(ROOT).parts[0].startswith(".")


def _search_dirs(top: str) -> list[Path] | Path | None:
    """Where the top-level module ``top`` lives (a file: it is no package), found unimported."""
    if (ROOT / top).is_dir() or (ROOT / f"{top}.py").is_file():
        return [ROOT]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations is None:
        return Path(spec.origin or "-")
    return [Path(p).parent for p in spec.submodule_search_locations]


def _module_file(name: str) -> Path | None:
    """The source of a module (a directory: a namespace package; a file not ending in .py:
    one that cannot be read), or None: no such module."""
    parts = name.split(".")
    dirs = _search_dirs(parts[0])
    if isinstance(dirs, Path):
        return dirs if len(parts) == 1 else None
    for where in dirs or []:
        path = where.joinpath(*parts)
        if (path / "__init__.py").is_file():
            return path / "__init__.py"
        if path.with_suffix(".py").is_file():
            return path.with_suffix(".py")
        if path.is_dir():
            return path
        if any(path.parent.glob(f"{parts[-1]}.*.so")):
            return Path("-")
    return None


@cache
def module_space(name: str) -> Space | None:
    path = _module_file(name)
    if path is None:
        return None
    if path.suffix != ".py" and not path.is_dir():
        return Space(module=name, kind="opaque", ours=False)
    space = Space(module=name, kind="module", ours=_ours(path), is_package=True)
    if path.is_file():
        space.is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        _fill(space, tree.body, name if space.is_package else name.rpartition(".")[0])
    return space


# --- resolving a dotted name: True (exists), False (does not), None (the source cannot say) ----


def _from_bases(space: Space, name: str, depth: int) -> Found:
    module = module_space(space.module)
    unknown = False
    for base in space.bases:
        if module is not None and base not in module.names and hasattr(builtins, base):
            if hasattr(getattr(builtins, base), name):
                return True, None
            continue
        found, inner = lookup(module, base, depth + 1)
        if found and inner is not None and inner.kind != "function":
            found, inner = member(inner, name, depth + 1)
            if found:
                return True, inner
        unknown = unknown or found is not False
    return (None, None) if unknown else (False, None)


def _bound(space: Space, name: str, depth: int) -> Found | None:
    """What ``name`` is bound to in ``space`` (None: it binds no such name)."""
    kind, what = space.names.get(name, (None, None))
    if kind == "ns":
        assert isinstance(what, Space)
        return True, what
    if kind == "ref":
        return resolve_static(str(what), depth + 1)
    return (True, None) if kind == "value" else None


def member(space: Space | None, name: str, depth: int = 0) -> Found:
    """``space.name``: whether it exists, and its space where it is a module or a class."""
    if space is None or space.kind == "opaque" or depth > 40:
        return None, None
    if space.kind == "function":  # an attribute of a function object
        return hasattr(member, name), None
    bound = _bound(space, name, depth)
    if bound is not None:
        return bound
    if space.kind == "module" and space.is_package:
        sub = module_space(f"{space.module}.{name}")
        if sub is not None:
            return True, sub
    if space.kind == "class":
        found, inner = _from_bases(space, name, depth)
    else:
        found, inner = False, None
        for source in space.stars:
            found, inner = member(module_space(source), name, depth + 1)
            if found is not False:
                break
    if found is False and not (space.ours and "__getattr__" not in space.names):
        return None, None  # names made at run time, or not our source: the import decides
    return found, inner


def walk(found: bool | None, space: Space | None, rest: list[str], depth: int = 0) -> Found:
    for name in rest:
        if not found:
            return found, None
        if space is None:  # an attribute of a value: the source cannot say
            return None, None
        found, space = member(space, name, depth)
    return found, space


def lookup(module: Space | None, dotted: str, depth: int = 0) -> Found:
    """``dotted`` as written in ``module`` (a name of it, else from the top)."""
    parts = dotted.split(".")
    if module is not None and parts[0] in module.names:
        return walk(*member(module, parts[0], depth), parts[1:], depth)
    return resolve_static(dotted, depth)


def resolve_static(dotted: str, depth: int = 0) -> Found:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        space = module_space(".".join(parts[:cut]))
        if space is not None:
            return walk(True, space, parts[cut:], depth)
    return False, None


@cache
def resolve_by_import(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except Exception:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def resolves(found: Found, dotted: str) -> bool:
    """The static answer, or where the source cannot say, the import's."""
    return found[0] if found[0] is not None else resolve_by_import(dotted)


# --- docstrings: every cross-reference ------------------------------------------------------


def _library_files() -> list[Path]:
    return [p for package in LIBRARY for p in sorted((ROOT / package).rglob("*.py"))]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _scopes(body: list[ast.stmt], chain: list[Space]) -> Iterator[tuple[int, int, list[Space]]]:
    """(first line, last line, the spaces around it, innermost first) of each def and class."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            _, inner = chain[0].names.get(node.name, (None, None))
            inner_chain = [inner, *chain] if isinstance(inner, Space) else chain
            yield node.lineno, node.end_lineno or node.lineno, inner_chain
            yield from _scopes(node.body, inner_chain)
        elif isinstance(node, BLOCKS) or type(node).__name__ == "TryStar":
            for block in ("body", "orelse", "finalbody"):
                yield from _scopes(getattr(node, block, []), chain)
            for handler in getattr(node, "handlers", []):
                yield from _scopes(handler.body, chain)


def _texts(source: str, space: Space) -> Iterator[tuple[int, str, list[Space]]]:
    """Every string (docstrings first of all) and comment of a module, with the spaces of the
    innermost def or class around it."""
    tree = ast.parse(source)
    scopes = list(_scopes(tree.body, [space]))

    def chain_at(line: int) -> list[Space]:
        around = [(first, chain) for first, last, chain in scopes if first <= line <= last]
        return max(around, key=lambda x: x[0])[1] if around else [space]

    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value, chain_at(node.lineno)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string, chain_at(token.start[0])


def reference_targets(text: str) -> Iterator[tuple[int, str]]:
    """(line offset, target) of each cross-reference in ``text``."""
    for match in ROLE.finditer(text):
        target = match.group(1)
        if target.endswith(">") and "<" in target:
            target = target[target.rindex("<") + 1 : -1]
        target = re.sub(r"\s+", "", target).lstrip("~!").removesuffix("()")
        yield text[: match.start()].count("\n"), target


def _resolve_in(chain: list[Space], target: str) -> bool:
    """``target`` as written in the innermost space of ``chain`` (its module last)."""
    module = chain[-1]
    if target.startswith("."):
        rest = target.lstrip(".")
        package = module.module if module.is_package else module.module.rpartition(".")[0]
        dotted = _absolute(package, len(target) - len(rest), rest)
        if resolves(resolve_static(dotted), dotted):
            return True
        target = rest
    parts = target.split(".")
    answers = []
    for space in chain:  # a function's locals, its class's members, the module's names
        first = _bound(space, parts[0], 0) if space.kind == "function" else member(space, parts[0])
        answers.append(walk(*first, parts[1:])[0] if first is not None else False)
    if True in answers:
        return True
    if module_space(parts[0]) is not None and resolves(resolve_static(target), target):
        return True  # from the top
    if None in answers:  # maybe named there, but its source cannot say: import where it is
        prefixes = [f"{s.module}.{s.qualname}".rstrip(".") for s in chain if s.kind != "function"]
        return any(resolve_by_import(f"{prefix}.{target}") for prefix in prefixes)
    if module_space(parts[0]) is not None:
        return False
    obj: object = builtins
    for name in parts:
        if not hasattr(obj, name):
            return False
        obj = getattr(obj, name)
    return True


def docstring_problems(path: Path) -> list[str]:
    space = module_space(_module_name(path))
    assert space is not None, path
    found = []
    for line, text, chain in _texts(path.read_text(encoding="utf-8"), space):
        for offset, target in reference_targets(text):
            if not _resolve_in(chain, target):
                found.append((line + offset, target))
    where = path.relative_to(ROOT)
    return [f"{where}:{line}: {target!r} does not resolve" for line, target in sorted(found)]


def test_every_docstring_cross_reference_resolves() -> None:
    files = _library_files()
    assert len(files) > 100
    problems = [p for path in files for p in docstring_problems(path)]
    assert not problems, f"{len(problems)} cross-references name nothing:\n" + "\n".join(problems)


# --- docs/*.md and README.md: every path and module named ------------------------------------

DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
PY_PATH = re.compile(r"[\w.*-]+(?:/[\w.*-]+)*\.py")
OTHER_PATH = re.compile(r"[\w-]+(?:/[\w.*-]+)+/?|[\w-]+/")
NAME = re.compile(r"[A-Za-z_]\w*(?:[.:][A-Za-z_]\w*)+(?:\(\))?")
LINK = re.compile(r"\]\(([^()\s]+)\)")


@cache
def repo_paths() -> tuple[set[str], set[str]]:
    """Every file and every directory of the repository (hidden and built ones aside)."""
    files: set[str] = set()
    dirs: set[str] = set()
    for where, subdirs, names in os.walk(ROOT):
        subdirs[:] = [d for d in subdirs if not (d.startswith(".") or d in SKIP_DIRS)]
        base = Path(where).relative_to(ROOT).as_posix()
        prefix = "" if base == "." else base + "/"
        dirs.update(prefix + d for d in subdirs)
        files.update(prefix + n for n in names)
    return files, dirs


def _library_spaces() -> Iterator[tuple[str, Space]]:
    for path in _library_files():
        space = module_space(_module_name(path))
        if space is not None:
            yield _module_name(path), space


@cache
def library_names() -> tuple[dict[str, list[Space]], set[str], set[str]]:
    """The library's classes by name, every name a class of it binds, and every function or
    class defined at a module's top."""
    classes: dict[str, list[Space]] = {}
    members: set[str] = set()
    top: set[str] = set()
    for _, module in _library_spaces():
        stack = [module]
        while stack:
            space = stack.pop()
            for name, (kind, what) in space.names.items():
                if space.kind == "class":
                    members.add(name)
                if isinstance(what, Space) and what.kind != "function":
                    classes.setdefault(name, []).append(what)
                    stack.append(what)
                if kind == "ns" and space.kind == "module":
                    top.add(name)
    return classes, members, top


@cache
def code_strings() -> set[str]:
    """The strings the library and ``pyproject.toml`` spell out (metadata keys, entry points)."""
    found = set(re.findall(r'"([^"\n]+)"', (ROOT / "pyproject.toml").read_text()))
    for path in _library_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.add(node.value)
    return found


def _is_module(name: str) -> bool:
    return name in repo_paths()[1] or module_space(name) is not None


def _short_form(parts: list[str]) -> bool | None:
    """``outcome.typed_error``: below a library module whose name ends in ``outcome``."""
    modules = [name for name, _ in _library_spaces()]
    for cut in range(len(parts) - 1, 0, -1):
        tail = "." + ".".join(parts[:cut])
        for module in (m for m in modules if ("." + m).endswith(tail)):
            dotted = ".".join([module, *parts[cut:]])
            if resolves(resolve_static(dotted), dotted):
                return True
    classes, members, top = library_names()
    if len(parts) == 2 and parts[1] in members:
        return None  # a variable's attribute (``report.served``)
    if any(part in classes for part in parts[1:]) or parts[-1] in top:
        return False  # a module path to a class or function of the library, through no module
    return None


def name_resolves(name: str) -> bool | None:
    """A dotted name of the documentation: True, False, or None where it is not checked."""
    name = name.removesuffix("()")
    if name in code_strings():
        return True
    parts = name.replace(":", ".").split(".")
    if parts[0] == "__main__":  # a package's ``python -m`` entry, ``benchmarks/__main__.py``
        mains = [f[: -len(".py")].replace("/", ".") for f in repo_paths()[0]]
        mains = [m for m in mains if m.endswith(".__main__")]
        dotted = [".".join([m, *parts[1:]]) for m in mains]
        return any(resolves(resolve_static(d), d) for d in dotted)
    if _is_module(parts[0]):
        return resolves(resolve_static(".".join(parts)), ".".join(parts))
    classes = library_names()[0]
    if parts[0] in classes:
        return any(walk(True, space, parts[1:])[0] is not False for space in classes[parts[0]])
    if parts[0][:1].isupper():
        return None  # a class of vLLM's or another library's
    return _short_form(parts)


def _file_of(path: str) -> str | None:
    """``path`` from the root, else the one or more files it is the tail of, else a file of
    the installed package its first part names."""
    files, dirs = repo_paths()
    path = path.rstrip("/")
    if path in files or path in dirs:
        return path
    tails = sorted(f for f in files | dirs if f.endswith("/" + path))
    if tails:
        return tails[0]
    where = _search_dirs(path.split("/")[0])
    if isinstance(where, list) and any((d / path).exists() for d in where):
        return path
    return None


def path_resolves(token: str) -> bool:
    path, _, test = token.partition("::")
    if "*" in path:
        return any(ROOT.glob(path))
    found = _file_of(path)
    if found is None or not test:
        return found is not None
    module = module_space(found.removesuffix(".py").replace("/", "."))
    names = [n for n in re.split(r"::", re.sub(r"\[.*", "", test)) if n]
    return module is not None and walk(True, module, names)[0] is not False


def _fences(text: str) -> tuple[str, list[tuple[int, str]]]:
    """The text with its fenced blocks blanked out, and each line of theirs (line, text)."""
    lines = text.split("\n")
    fenced_lines = []
    fenced = False
    for i, line in enumerate(lines):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            lines[i] = ""
        elif fenced:
            fenced_lines.append((i + 1, line))
            lines[i] = ""
    return "\n".join(lines), fenced_lines


def code_spans(text: str) -> Iterator[tuple[int, int, str]]:
    """(start, end, content) of each inline code span, as CommonMark pairs backtick runs."""
    i = 0
    while (run := re.compile(r"`+").search(text, i)) is not None:
        ticks = run.group()
        close = re.compile(rf"(?<!`){ticks}(?!`)").search(text, run.end())
        if close is None:
            i = run.end()
            continue
        yield run.start(), close.end(), text[run.end() : close.start()].replace("\n", " ").strip()
        i = close.end()


def _span_problems(span: str) -> Iterator[str]:
    top_dirs = {d for d in repo_paths()[1] if "/" not in d}
    span = re.sub(r"\[[^\]\s]*\]", "", span)  # a test's parameters, an index
    for token in re.split(r"[\s,;()\"'=\[\]{}]+", span):
        token = token.strip(".:")
        if PY_PATH.fullmatch(token.partition("::")[0]):
            if not path_resolves(token):
                yield f"{token!r} is no file" + (" or no test of it" if "::" in token else "")
        elif OTHER_PATH.fullmatch(token) and token.split("/")[0] in top_dirs:
            if not path_resolves(token):
                yield f"{token!r} is no file or directory"
        elif NAME.fullmatch(token) and name_resolves(token) is False:
            yield f"{token!r} does not resolve"


def markdown_problems(doc: Path) -> list[str]:
    text, fenced = _fences(doc.read_text(encoding="utf-8"))
    where = doc.relative_to(ROOT)
    problems = [f"{where}:{line}: {p}" for line, block in fenced for p in _span_problems(block)]
    outside = text
    for start, end, span in code_spans(text):
        outside = outside[:start] + " " * (end - start) + outside[end:]
        line = text.count("\n", 0, start) + 1
        problems += [f"{where}:{line}: {p}" for p in _span_problems(span)]
    for link in LINK.finditer(outside):
        target = link.group(1).partition("#")[0]
        if target and not re.match(r"[a-z]+:", target) and not (doc.parent / target).exists():
            line = text.count("\n", 0, link.start()) + 1
            problems.append(f"{where}:{line}: the link {target!r} is no file")
    return sorted(problems, key=lambda p: int(p.split(":")[1]))


def test_every_path_and_module_the_docs_name_exists() -> None:
    assert len(DOCS) > 5
    problems = [p for doc in DOCS for p in markdown_problems(doc)]
    assert not problems, f"{len(problems)} names in the docs name nothing:\n" + "\n".join(problems)


def test_the_checks_catch_a_stale_name_of_each_kind() -> None:
    session = module_space("weight_bridge.direct.session")
    assert session is not None
    for target in (
        "weight_bridge.ColocatedEngine",  # lazily exported: its TYPE_CHECKING import
        "~weight_bridge.vllm.clients.bridge_client.BridgeClient.push_async",
        ".undo.HostStore",
        "..sync.sender.Sent",
        "DirectReloadError.args",  # a builtin base's member
        "re.sub",
    ):
        assert _resolve_in([session], target.lstrip("~")), target
    for target in (
        "weight_bridge.vllm.ColocatedEngine",
        "weight_bridge.checkpoint.Sent",
        ".nowhere.HostStore",
        "NoSuchName",
        "DirectReloadError.no_such_member",
        "re.no_such_function",
    ):
        assert not _resolve_in([session], target), target
    good = "server/middleware.py by_name.start_engine report.served model.norm bench/ tests/"
    assert not list(_span_problems(good))
    assert not list(
        _span_problems("tests/test_trust.py::test_a_path_leading_out_of_the_root_is_refused")
    )
    stale = (
        "server_middleware.py",
        "engines.start_engine",
        "client.BridgeClient.push_async",
        "weight_bridge/vllm/nothing/",
        "tests/test_trust.py::test_nothing",
    )
    for token in stale:
        assert len(list(_span_problems(token))) == 1, token
