"""Run the core's tests against the installed package: the release wheels' test command.

cibuildwheel installs each wheel into a clean environment (NumPy and pytest, no framework) and
runs ``python {project}/tools/wheel_test.py {project}``. The test files are copied into a fresh
temporary folder and run there: pytest puts a test file's folder first on ``sys.path``, and in
the source tree that folder is ``tests/``, whose subfolders ``torch/`` and ``keras/`` Python
would import as the frameworks ``torch`` and ``keras`` where those are not installed (the torch
cases would then run against a folder instead of skipping). The copy also keeps the checkout's
``gradient_accumulator/`` (which has no compiled module) off the path, so the installed package
is the one tested. Cases that need torch skip themselves without it and run with it.

Usage: python tools/wheel_test.py [PROJECT] [extra pytest arguments]
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import tempfile

#: The framework-free test files (NumPy only), and the module they import.
FILES = (
    "helpers.py",
    "test_core_accumulate.py",
    "test_core_apply.py",
    "test_core_batchnorm.py",
    "test_core_errors.py",
    "test_core_norms.py",
    "test_core_buffers.py",
)


def main(argv: list[str]) -> int:
    project = pathlib.Path(argv[0] if argv else pathlib.Path(__file__).parents[1]).resolve()
    with tempfile.TemporaryDirectory(prefix="ga-wheel-test-") as tmp:
        for name in FILES:
            shutil.copy2(project / "tests" / name, tmp)
        command = [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            "-c", str(project / "pyproject.toml"), "--rootdir", tmp, "--confcutdir", tmp,
            *argv[1:],
            *[name for name in FILES if name.startswith("test_")],
        ]  # fmt: skip
        return subprocess.call(command, cwd=tmp)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
