"""Every Python example in ``README.md`` and ``docs/*.md`` runs as written.

Each `` ```python `` block is written to a script of its own and run in a fresh, empty working
directory, in a subprocess, as a user would paste it: vLLM's default multi-process engine (so a
script without ``if __name__ == "__main__":`` fails, as it would for the user), no
``VLLM_*`` or ``WEIGHT_BRIDGE_*`` variable from the test session (the bridge's engines then take
the working directory as their checkpoint root), only ``VLLM_CPU_KVCACHE_SPACE=1`` and
``HF_HUB_OFFLINE=1`` set. It must exit 0 and print what its comments say it prints
(:data:`PRINTS`: every ``print`` of an example has its expected line there, checked in order
among vLLM's log lines). Blocks not meant to run are fenced as ``text``,
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

# What each ``print`` of the examples prints, as the comment beside it says: the print's line in
# the example -> a pattern per line it prints (``re.fullmatch``; a loop's print, one per pass).
_SPANS = r"\[\(None, 0, \d+\)(, \('1', \d+, 120\))?\]"  # from None (initial), then maybe '1'
PRINTS: dict[str, list[str]] = {
    # [0, 1, 2, 3]: a push at start, then each step
    'print([record["step"] for record in sync.history])': [r"\[0, 1, 2, 3\]"],
    # [(0, 'tensors in memory, version 0'), ...]: pushed from memory at start, then each step
    'print([(r["step"], r["checkpoint"]) for r in sync.history])': [
        r"\[" + ", ".join(rf"\({i}, 'tensors in memory, version {i}'\)" for i in range(3)) + r"\]"
    ],
    # direct | 15 weights written directly, ...
    'print(report.mode, "|", report.reason)': [r"direct \| 15 weights written directly, .*"],
    # 1, one span: '1', tokens 0-8
    "print(llm.get_weight_version(), out[0].outputs[0].weight_versions)": [
        r"1 \[WeightVersionSpan\(version='1', start=0, end=8\)\]"
    ],
    # the same Generation as in process: all "1"
    "print(out.completions[0].versions)": [r"\['1'(, '1'){7}\]"],
    'print(f"generation paused {report.paused_s:.3f} s")': [r"generation paused \d+\.\d{3} s"],
    # rollouts 0, 16 and 32 of 48: the first submitted starts on None (before the push)
    "print([(span.version, span.start, span.end) for span in out.completions[0].spans])": [
        _SPANS,
        rf"{_SPANS}|\[\('1', 0, 120\)\]",
        rf"{_SPANS}|\[\('1', 0, 120\)\]",
    ],
    # {'1.weight': 'its module has derived state weight_t ...'}
    "print(refused.problems)": [r"\{'1\.weight': 'its module has derived state weight_t .*'\}"],
    # {'1': 'transposed copy'}
    "print(direct_reload(model, new).refreshed)": [r"\{'1': 'transposed copy'\}"],
    "print(reload.report)": [r"ReloadReport\(tensors=1, bytes=256, direct=1, .*\)"],  # partial
}


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
    # what vLLM's CPU platform leaves in any process that started an engine (this one's too,
    # depending on which tests ran first): set as such a parent leaves it, so no example depends
    # on it (an engine in the trainer's ranks once took it for its ranks per node)
    env["LOCAL_WORLD_SIZE"] = "1"
    return env


def test_the_documents_have_python_examples() -> None:
    assert len(_examples()) >= 6, "the README's examples were not found"


def _prints(code: str) -> list[str]:
    """The example's ``print`` lines (stripped, comment dropped), in order."""
    lines = [line.split("  #")[0].strip() for line in code.splitlines()]
    return [line for line in lines if line.startswith("print(")]


def test_every_print_of_an_example_has_its_expected_output() -> None:
    """A new ``print`` in an example needs its line in :data:`PRINTS`, so that the example test
    checks it; an entry no example has any more is stale."""
    prints = [p for param in _examples() for p in _prints(param.values[0])]
    assert sorted(set(prints) - set(PRINTS)) == [], "add what these print to PRINTS"
    assert sorted(set(PRINTS) - set(prints)) == [], "no example prints these any more"


def _expected_lines(code: str) -> list[str]:
    return [pattern for line in _prints(code) for pattern in PRINTS[line]]


def _unmatched(stdout: str, patterns: list[str]) -> list[str]:
    """The patterns not matched, in order, by lines of ``stdout`` (other lines, vLLM's log, are
    skipped)."""
    left = list(patterns)
    for line in stdout.splitlines():
        if left and re.fullmatch(left[0], line.strip()):
            left.pop(0)
    return left


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
    missing = _unmatched(proc.stdout, _expected_lines(code))
    assert missing == [], (
        f"not printed (in this order): {missing}\n--- stdout\n{proc.stdout[-3000:]}"
    )
