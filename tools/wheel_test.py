"""Run the core's tests against the installed package: the release wheels' test command.

cibuildwheel installs each wheel into a clean environment (NumPy and pytest, no framework) and
runs ``python {project}/tools/wheel_test.py {project}``. The test files are copied into a fresh
temporary folder and run there: pytest puts a test file's folder first on ``sys.path``, and in
the source tree that folder is ``tests/``, whose subfolders ``torch/`` and ``keras/`` Python
would import as the frameworks ``torch`` and ``keras`` where those are not installed (the torch
cases would then run against a folder instead of skipping). The copy also keeps the checkout's
``gradient_accumulator/`` (which has no compiled module) off the path, so the installed package
is the one tested. Cases that need torch skip themselves without it and run with it.

With ``--expect-cuda`` (the Linux wheels' command) the installed package must have the CUDA
kernels (``core.has_cuda()``); the CUDA tests then check that on a machine without a usable
driver or GPU a CUDA tensor is refused with the reason (``core.cuda_status()``), not as a build
without kernels.

Usage: python tools/wheel_test.py [PROJECT] [--expect-cuda] [extra pytest arguments]
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
    "test_core_cuda_dispatch.py",
    "test_core_cuda_status.py",
)


def main(argv: list[str]) -> int:
    project = pathlib.Path(argv[0] if argv else pathlib.Path(__file__).parents[1]).resolve()
    argv = argv[1:] if argv else []
    if "--expect-cuda" in argv:
        argv = [a for a in argv if a != "--expect-cuda"]
        code = (
            "from gradient_accumulator import core; s = core.cuda_status(); "
            "print('CUDA kernels:', core.has_cuda(), '| cuda_status:', s.reason); "
            "raise SystemExit(0 if core.has_cuda() else 1)"
        )
        if subprocess.call([sys.executable, "-c", code], cwd=tempfile.gettempdir()) != 0:
            print("--expect-cuda: this wheel has no CUDA kernels")
            return 1
    with tempfile.TemporaryDirectory(prefix="ga-wheel-test-") as tmp:
        for name in FILES:
            shutil.copy2(project / "tests" / name, tmp)
        command = [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            "-c", str(project / "pyproject.toml"), "--rootdir", tmp, "--confcutdir", tmp,
            *argv,
            *[name for name in FILES if name.startswith("test_")],
        ]  # fmt: skip
        return subprocess.call(command, cwd=tmp)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
