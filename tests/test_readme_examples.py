"""Every ```python block of every README runs as written (the examples are the docs)."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
READMES = sorted([ROOT / "README.md", *ROOT.glob("packages/*/README.md")])
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def blocks():
    for readme in READMES:
        for number, match in enumerate(BLOCK.finditer(readme.read_text()), start=1):
            yield pytest.param(match.group(1), id=f"{readme.relative_to(ROOT)}#{number}")


@pytest.mark.parametrize("code", list(blocks()))
def test_readme_block_runs(code, tmp_path, monkeypatch):
    """The block executes without error in a fresh namespace and working directory."""
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "example.py"
    script.write_text(code)
    runpy.run_path(str(script), run_name="__main__")


def test_every_package_has_an_example():
    """Each package README carries at least one runnable python block."""
    missing = [str(p.relative_to(ROOT)) for p in READMES[1:] if not BLOCK.search(p.read_text())]
    assert [] == missing
