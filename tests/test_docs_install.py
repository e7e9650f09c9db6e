"""Every install line of the README and the documentation installs this package, as written today.

Version 1.0 is not on PyPI: there ``gradient-accumulator`` is 0.5.2, the TensorFlow 2 package,
so a ``pip install`` that names the project without a source (a ``git+`` URL or a checkout)
installs the wrong package. The README's install line is the site's, word for word, and every
extra an install line names exists. (When 1.0 is published, this test is where the lines change.)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.9/3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SOURCE = "git+https://github.com/gradient-accumulator/gradient-accumulator"


def _shell_lines(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    blocks = re.findall(r"```(?:bash|sh|console|shell)\n(.*?)```", text, flags=re.S)
    return [line.split("#", 1)[0] for block in blocks for line in block.splitlines()]


def _installs(line: str) -> list[str]:
    """The requirements a ``pip install`` line names (options and their values left out)."""
    match = re.search(r"pip install (.*?)(?:&&|$)", line)
    if not match:
        return []
    words = match.group(1).split()
    reqs, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word.startswith("-"):
            skip = word in ("--extra-index-url", "--index-url", "-r", "-c", "--no-binary", "-C")
        else:
            reqs.append(word.strip("\"'"))
    return reqs


def _pages_with_installs() -> list[tuple[Path, str]]:
    return [(p, line) for p in PAGES for line in _shell_lines(p) if _installs(line)]


def test_the_pages_have_install_lines():
    assert len(_pages_with_installs()) >= 4  # README, index, both getting-started pages


@pytest.mark.parametrize(
    ("page", "line"),
    _pages_with_installs(),
    ids=[f"{p.relative_to(ROOT)}:{i}" for i, (p, _) in enumerate(_pages_with_installs())],
)
def test_an_install_line_installs_this_package_from_source(page, line):
    extras = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    for req in _installs(line):
        name = re.split(r"[\[@ ]", req, maxsplit=1)[0]
        named = re.search(r"\[([^\]]+)\]", req)
        if name == "gradient-accumulator":
            from_source = re.search(
                rf"gradient-accumulator(\[[\w,-]+\])? @ {re.escape(SOURCE)}", line
            )
            assert from_source, f"{page.name}: {line!r} installs 0.5.2 from PyPI"
        if named and (name == "gradient-accumulator" or req.startswith(".")):
            assert set(named.group(1).split(",")) <= extras, f"{page.name}: {req!r}"


def test_the_readme_install_line_is_the_sites():
    readme = [line.strip() for line in _shell_lines(ROOT / "README.md") if SOURCE in line]
    assert len(readme) == 1, readme
    for page in ("docs/index.md", "docs/getting-started/torch.md"):
        lines = [line.strip() for line in _shell_lines(ROOT / page)]
        assert readme[0] in lines, page
