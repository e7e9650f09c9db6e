"""Release checks: one version everywhere, and what the wheel and the sdist hold.

The wheel and sdist checks read the artifacts named by ``GA_WHEEL`` / ``GA_SDIST`` (set by
``.ci/run``, which builds them with ``python -m build`` and runs the tests against that wheel).
"""

from __future__ import annotations

import email
import importlib.metadata
import os
import pathlib
import re
import sys
import tarfile
import zipfile

import pytest

import gradient_accumulator
from gradient_accumulator import _C

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python < 3.11
    tomllib = pytest.importorskip("tomli")

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYTHONS = ["3.9", "3.10", "3.11", "3.12", "3.13"]


def _artifact(variable: str) -> pathlib.Path:
    path = os.environ.get(variable)
    if not path:
        pytest.skip(f"{variable} names no built artifact (.ci/run sets it)")
    return pathlib.Path(path)


def test_version_is_written_once():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in pyproject["project"]
    assert "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["scikit-build"]["metadata"]["version"]["input"] == (
        "gradient_accumulator/__init__.py"
    )
    cmake = (ROOT / "CMakeLists.txt").read_text(encoding="utf-8")
    assert "project(gradient_accumulator VERSION ${_ga_version}" in cmake
    assert not re.search(r"project\([^)]*VERSION\s+\d", cmake)
    init = (ROOT / "gradient_accumulator" / "__init__.py").read_text(encoding="utf-8")
    assert len(re.findall(r"^__version__ = ", init, flags=re.M)) == 1


def test_version_is_1_0_and_agrees_with_the_compiled_core():
    version = gradient_accumulator.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", version)
    assert tuple(int(p) for p in version.split(".")) >= (1, 0, 0)  # above 0.5.2 on PyPI
    assert _C.__version__ == version


def test_installed_metadata_version():
    try:
        dist = importlib.metadata.distribution("gradient-accumulator")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the package is imported from a checkout, not installed")
    installed = pathlib.Path(dist.locate_file("gradient_accumulator/__init__.py")).resolve()
    if installed != pathlib.Path(gradient_accumulator.__file__).resolve():
        pytest.skip("another copy of the package is installed than the one imported")
    assert dist.version == gradient_accumulator.__version__


def test_wheel_holds_the_package_only():
    wheel = _artifact("GA_WHEEL")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        metadata = email.message_from_bytes(
            zf.read(next(n for n in names if n.endswith(".dist-info/METADATA")))
        )
    top = {n.split("/")[0] for n in names}
    assert top == {"gradient_accumulator", f"gradient_accumulator-{metadata['Version']}.dist-info"}
    for required in (
        "gradient_accumulator/_C.pyi",
        "gradient_accumulator/py.typed",
        "gradient_accumulator/__init__.py",
        "gradient_accumulator/torch/__init__.py",
        "gradient_accumulator/keras/__init__.py",
    ):
        assert required in names
    assert [n for n in names if re.fullmatch(r"gradient_accumulator/_C\..*(so|pyd)", n)]
    for forbidden in ("tests/", "benchmarks/", "examples/", "docs/", "csrc/", "conftest"):
        assert not [n for n in names if forbidden in n], forbidden
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]

    assert metadata["Version"] == gradient_accumulator.__version__
    assert metadata["Name"] == "gradient-accumulator"
    assert metadata["Requires-Python"] == ">=3.9"
    classifiers = metadata.get_all("Classifier")
    for python in PYTHONS:
        assert f"Programming Language :: Python :: {python}" in classifiers
    assert "License :: OSI Approved :: MIT License" in classifiers
    urls = dict(u.split(", ", 1) for u in metadata.get_all("Project-URL"))
    assert {"Homepage", "Documentation", "Source", "Changelog"} <= set(urls)
    assert metadata["Description-Content-Type"] == "text/markdown"
    assert metadata.get_payload().lstrip().startswith("# gradient-accumulator")


def test_sdist_builds_everything_and_carries_the_license():
    sdist = _artifact("GA_SDIST")
    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    for required in (
        "pyproject.toml",
        "CMakeLists.txt",
        "LICENSE",
        "README.md",
        "CHANGELOG.md",
        "csrc/include/gradient_accumulator/gradient_accumulator.h",
        "gradient_accumulator/_C.pyi",
    ):
        assert required in names, required
    assert not [n for n in names if n.endswith((".so", ".pyd"))]
    assert not [n for n in names if n.startswith((".github/", "build/", "dist/"))]


def test_wheel_test_command_runs_test_files_that_exist():
    """cibuildwheel tests every wheel with the core's test files named in pyproject; a renamed
    file would break only the release workflow (which runs on GitHub, not in .ci/run)."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    command = pyproject["tool"]["cibuildwheel"]["test-command"]
    files = re.findall(r"\{project\}/(tests/\S+\.py)", command)
    assert len(files) >= 5, command
    missing = [f for f in files if not (ROOT / f).is_file()]
    assert not missing, f"test-command names missing files: {missing}"
