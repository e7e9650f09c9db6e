"""``help(gradient_accumulator)`` and the imports a first user tries, in installs that lack a
framework.

A missing framework is stood in for by a module of its name, first on ``sys.path``, whose import
fails as the real one fails when it is absent or has no backend (``ModuleNotFoundError``). Each
case runs in its own interpreter, on the package under test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import gradient_accumulator

PACKAGE_PARENT = str(Path(gradient_accumulator.__file__).resolve().parents[1])
KERAS_NAMES = ("GradientAccumulateModel", "AccumBatchNormalization", "replace_batchnorm_layers")


def _run(code: str, tmp_path: Path, missing: tuple[str, ...] = (), **env: str) -> str:
    for name in missing:  # what `import name` raises where the framework is not installed
        stub = tmp_path / "missing" / name
        stub.mkdir(parents=True)
        (stub / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{name}'\", name={name!r})\n"
        )
    path = [str(tmp_path / "missing"), PACKAGE_PARENT, os.environ.get("PYTHONPATH", "")]
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p), **env},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_help_and_star_import_without_keras(tmp_path):
    """A torch-only install (Keras missing, or Keras without a backend): help() renders, lists
    what resolves, and the Keras names are left out of __all__ and dir()."""
    out = _run(
        """
        import pydoc
        import gradient_accumulator as ga
        text = pydoc.render_doc(ga, renderer=pydoc.plaintext)
        print("HELP", len(text), "NonFiniteGradientWarning" in text)
        print("ALL", sorted(ga.__all__))
        print("DIR", sorted(dir(ga)))
        namespace = {}
        exec("from gradient_accumulator import *", namespace)
        print("STAR", sorted(k for k in namespace if not k.startswith("__")))
        """,
        tmp_path,
        missing=("keras",),
    )
    assert "HELP" in out and out.split("HELP ")[1].split()[1] == "True"
    for line in ("ALL", "DIR", "STAR"):
        listed = next(x for x in out.splitlines() if x.startswith(line))
        assert "core" in listed and "NonFiniteGradientError" in listed, listed
        assert not any(name in listed for name in KERAS_NAMES), listed
        assert "GradientAccumulateOptimizer" not in listed


def test_a_keras_name_without_keras_says_which_install_works(tmp_path):
    out = _run(
        """
        try:
            from gradient_accumulator import GradientAccumulateModel
        except ImportError as e:
            print("ERROR", e)
        try:
            import gradient_accumulator.layers
        except ImportError as e:
            print("MODULE", e)
        """,
        tmp_path,
        missing=("keras",),
    )
    for line in ("ERROR", "MODULE"):
        message = next(x for x in out.splitlines() if x.startswith(line))
        assert "gradient-accumulator[tensorflow]" in message, message
        assert "gradient-accumulator[jax]" in message and "KERAS_BACKEND=torch" in message
        assert "No module named 'keras'" in message
        assert "gradient-accumulator[keras]'" not in message  # no backend: it would not work


def test_the_torch_adapter_without_torch_says_which_install_works(tmp_path):
    out = _run(
        """
        import gradient_accumulator.core as core  # the framework-free core still imports
        print("CORE", core.has_cuda() in (True, False))
        try:
            import gradient_accumulator.torch
        except ImportError as e:
            print("ERROR", e)
        """,
        tmp_path,
        missing=("torch",),
    )
    assert "CORE True" in out
    message = next(x for x in out.splitlines() if x.startswith("ERROR"))
    assert "gradient-accumulator[torch]" in message and "No module named 'torch'" in message


def test_help_in_a_keras_only_install_lists_the_keras_names(tmp_path):
    pytest.importorskip("keras")
    pytest.importorskip("jax")
    out = _run(
        """
        import pydoc
        import gradient_accumulator as ga
        text = pydoc.render_doc(ga, renderer=pydoc.plaintext)
        print("ALL", sorted(ga.__all__))
        names = ("GradientAccumulateModel", "AccumBatchNormalization")
        print("HELP", all(n in text for n in names))
        """,
        tmp_path,
        missing=("torch",),
        KERAS_BACKEND="jax",
    )
    listed = next(x for x in out.splitlines() if x.startswith("ALL"))
    assert all(name in listed for name in KERAS_NAMES), listed
    assert "HELP True" in out
