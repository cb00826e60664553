"""``make setup`` on a fresh machine: PyPI serves no ``+cpu`` torch wheels, so the Makefile's
torch line must name PyTorch's CPU wheel index, as ``--index-url`` (which replaces only pip's
primary index, keeping a configured ``find-links``/``extra-index-url``; a command-line
``--extra-index-url`` would replace the configured one)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _variables(makefile: str) -> dict[str, str]:
    found = re.findall(r"^([A-Z_]+)\s*\??:?=\s*(.*?)\s*$", makefile, flags=re.M)
    return dict(found)


def _pip_lines(makefile: str) -> list[list[str]]:
    """The recipe lines running ``$(PIP) install``, as argument lists, variables expanded."""
    variables = _variables(makefile)
    out = []
    for line in makefile.splitlines():
        if not line.startswith("\t$(PIP) install"):
            continue
        expanded = re.sub(r"\$\(([A-Z_]+)\)", lambda m: variables.get(m[1], m[0]), line)
        out.append(shlex.split(expanded))
    return out


def _setups(makefile: str) -> tuple[str, str]:
    """The Makefile with only the default setup's recipe (vLLM 0.32), and with only 0.34's."""
    head, rest = makefile.split("ifeq ($(VLLM),0.34)\nsetup:", 1)
    vllm034, rest = rest.split("\nelse\n", 1)
    default, tail = rest.split("\nendif\n", 1)
    return head + default + tail, head + vllm034 + tail


def test_torch_comes_from_pytorch_cpu_index() -> None:
    lines = _pip_lines(_setups((ROOT / "Makefile").read_text())[0])
    first_torch = next(args for args in lines if any(a.startswith("torch==") for a in args))
    assert "torch==2.13.0+cpu" in first_torch
    assert first_torch[first_torch.index("--index-url") + 1] == TORCH_CPU_INDEX
    assert "--extra-index-url" not in first_torch  # would drop the config's own
    # Later lines may ask for the same torch (satisfied by then); none names another build.
    for args in lines:
        assert all(a == "torch==2.13.0+cpu" for a in args if a.startswith("torch=="))


def test_vllm034_gets_pypis_torch_and_the_cpu_wheel() -> None:
    """``make setup VLLM=0.34``: torch 2.14.0 as PyPI ships it (what the wheel was built
    against, ../shared/wheels/README.md) in every line, and the wheel itself."""
    makefile = (ROOT / "Makefile").read_text()
    lines = _pip_lines(_setups(makefile)[1])
    pins = [a for args in lines for a in args if a.startswith("torch==")]
    assert pins and set(pins) == {"torch==2.14.0"}
    assert not any("--index-url" in args for args in lines)
    assert any("$(VLLM034_WHEEL)" in args for args in lines)
    assert "vllm-0.34.0+cpu-" in makefile.split("VLLM034_WHEEL ?=", 1)[1].split("\n\n", 1)[0]


def test_readme_install_names_the_index() -> None:
    readme = (ROOT / "README.md").read_text()
    install = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    assert TORCH_CPU_INDEX in install
