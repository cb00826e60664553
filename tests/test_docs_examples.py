"""Every Python example in ``README.md`` and ``docs/*.md`` runs as written.

Each `` ```python `` block is written to a script of its own and run in a fresh, empty working
directory, in a subprocess, as a user would paste it: vLLM's default multi-process engine (so a
script without ``if __name__ == "__main__":`` fails, as it would for the user), no
``VLLM_*`` or ``WEIGHT_BRIDGE_*`` variable from the test session (the bridge's engines then take
the working directory as their checkpoint root), only ``VLLM_CPU_KVCACHE_SPACE=1`` and
``HF_HUB_OFFLINE=1`` set. It must exit 0. Blocks not meant to run are fenced as ``text``,
``bash`` or ``yaml``; every fence must name its language, so no example escapes this test by
accident. Examples that start an engine are ``slow`` (20-60 s each on 2 cores, more under load).

Also checked, fast: every relative link of the README and the docs points at a file that exists,
and at a heading of it where it names one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
LANGUAGES = {"python", "bash", "text", "yaml", "json"}
ENGINE_WORDS = ("vllm", "callbacks", "ColocatedEngine", "VLLMServer")
EXAMPLE_TIMEOUT_S = 900  # one example; the engine ones measured 73-129 s each at load 3-4


def _blocks() -> list[tuple[Path, int, str, str]]:
    """(file, line, language, code) of every fenced block."""
    out = []
    for path in DOCS:
        text = path.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            out.append((path, line, match.group(1), match.group(2)))
    return out


def _examples() -> list:
    params = []
    for path, line, language, code in _blocks():
        if language != "python":
            continue
        slow = any(word in code for word in ENGINE_WORDS)
        marks = [pytest.mark.slow] if slow else []
        name = f"{path.relative_to(ROOT)}:{line}"
        params.append(pytest.param(code, id=name, marks=marks))
    return params


def _environment() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VLLM_", "WEIGHT_BRIDGE_", "PYTEST_"))
    }
    env.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def test_the_documents_have_python_examples() -> None:
    assert len(_examples()) >= 6, "the README's examples were not found"


def test_every_fence_names_its_language() -> None:
    """An unnamed or misspelt fence (```py, ```Python) would hide an example from this test."""
    bad = [
        f"{path.relative_to(ROOT)}:{line}: ```{language}"
        for path, line, language, _ in _blocks()
        if language not in LANGUAGES
    ]
    assert bad == [], f"fences must be one of {sorted(LANGUAGES)}"


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    headings = re.findall(r"^#+ (.+)$", FENCE.sub("", path.read_text()), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_links_to_files_and_headings_resolve() -> None:
    missing = []
    for path in DOCS:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", path.read_text()):
            if "://" in target:
                continue
            file = path.parent / target if target else path
            if not file.exists():
                missing.append(f"{path.relative_to(ROOT)} -> {target}")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                missing.append(f"{path.relative_to(ROOT)} -> {target}#{anchor}")
    assert missing == []


@pytest.mark.timeout(EXAMPLE_TIMEOUT_S + 60)
@pytest.mark.parametrize("code", _examples())
def test_example_runs_as_written(code: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(code)
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=work,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=EXAMPLE_TIMEOUT_S,
    )
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n"
        f"{proc.stderr[-6000:]}"
    )
