"""Executes the tutorial notebooks (docs/tutorials) with nbclient, as a reader would run them.

Each notebook trains the big batch, ours and the naive recipe, draws their loss curves and
asserts in its last cell that ours matches the big batch (within the tolerance it states). A
notebook passes when every cell runs without error and it produced its plot.

When ``GA_EXECUTED_NOTEBOOKS`` names a folder, the executed copies are written there, and the
documentation build renders them instead of executing the notebooks a second time (docs/conf.py).
"""

from __future__ import annotations

import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")
pytest.importorskip("sklearn")
pytest.importorskip("tqdm")

import gradient_accumulator  # noqa: E402

TUTORIALS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "tutorials"
TIMEOUT_S = 600  # per cell; each notebook takes seconds on an idle 2-core machine

# The Keras tutorial runs on any backend; CI runs it on the first of GA_NOTEBOOK_BACKENDS
# (default: JAX, the quickest here; the Keras test suite covers every backend) and its executed
# copy is the one the documentation shows. GA_NOTEBOOK_BACKENDS=jax,torch,tensorflow runs all.
KERAS_BACKENDS = os.environ.get("GA_NOTEBOOK_BACKENDS", "jax").split(",")
CASES = [
    ("torch_digits", None),
    ("bf16_accumulation", None),
    ("distributed_cpu", None),
    *[("keras_digits", backend.strip()) for backend in KERAS_BACKENDS],
]


def _kernel_env(backend: str | None) -> dict[str, str]:
    env = dict(os.environ)
    # The kernel imports the package this test imported (installed or checkout), not another.
    package_root = str(pathlib.Path(gradient_accumulator.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    # The package's own deprecation warnings as errors (IPython may show them instead: the test
    # also reads the cells' stderr).
    env["PYTHONWARNINGS"] = "error::gradient_accumulator.GradientAccumulatorDeprecationWarning"
    if backend is not None:
        env["KERAS_BACKEND"] = backend
    return env


@pytest.mark.parametrize(
    ("name", "backend"), CASES, ids=[n if b is None else f"{n}-{b}" for n, b in CASES]
)
def test_notebook_runs_and_matches_big_batch(name, backend, tmp_path):
    if backend is not None:
        pytest.importorskip({"jax": "jax", "torch": "torch", "tensorflow": "tensorflow"}[backend])
    else:
        pytest.importorskip("torch")
    source = TUTORIALS / f"{name}.ipynb"
    nb = nbformat.read(source, as_version=4)
    assert not any(
        c.get("outputs") for c in nb.cells if c.cell_type == "code"
    ), f"{source.name} is stored with outputs; clear them before committing"
    client = nbclient.NotebookClient(
        nb, timeout=TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": tmp_path}}
    )
    client.execute(env=_kernel_env(backend))

    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    outputs = [o for c in code_cells for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "no plot was drawn"
    assert "assert " in code_cells[-1].source, "the last cell must assert the comparison"
    printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    stderr = "".join(o.get("text", "") for o in outputs if o.get("name") == "stderr")
    assert "GradientAccumulatorDeprecationWarning" not in stderr, stderr
    assert "ours" in printed and "big batch" in printed

    folder = os.environ.get("GA_EXECUTED_NOTEBOOKS")
    if folder and backend in (None, KERAS_BACKENDS[0].strip()):
        pathlib.Path(folder).mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, pathlib.Path(folder) / source.name)
