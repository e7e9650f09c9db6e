"""Sphinx configuration of the gradient-accumulator documentation site.

Build: ``sphinx-build -W -b html docs docs/_build/html`` with the package installed (the API pages
import it) and Doxygen on PATH (the C API pages are read from the public headers).

Notebooks (``tutorials/*.ipynb``) are stored without outputs. The test suite executes them
(``tests/test_notebooks.py``); when ``GA_EXECUTED_NOTEBOOKS`` names the folder it wrote the
executed copies to, the build renders those copies instead of running the notebooks again.
Otherwise myst-nb executes every notebook that has no outputs.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess

# The API pages import gradient_accumulator.keras, hence Keras and its backend: JAX unless
# KERAS_BACKEND says otherwise (requirements-docs.txt installs JAX, not TensorFlow); the
# notebooks' kernels inherit it. Keep TF quiet where it is the backend.
os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import gradient_accumulator  # noqa: E402

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
GENERATED = ROOT / "build" / "docs"  # build products outside the source tree

project = "gradient-accumulator"
author = "gradient-accumulator developers"
copyright = "2026, gradient-accumulator developers"
release = gradient_accumulator.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "matplotlib.sphinxext.plot_directive",
    "breathe",
]
exclude_patterns = ["_build", "jupyter_execute", "**.ipynb_checkpoints"]
html_theme = "furo"
html_title = f"gradient-accumulator {release}"

# ---- MyST and notebooks ----
myst_enable_extensions = ["colon_fence", "deflist", "dollarmath"]
myst_heading_anchors = 3
nb_execution_mode = "auto"
nb_execution_raise_on_error = True
nb_execution_timeout = 600
nb_merge_streams = True
suppress_warnings = [
    # benchmarks/README.md is included as it is written for GitHub (it skips heading levels).
    "myst.header",
    # C's `typedef struct ga_x {...} ga_x;` is one name to C and two declarations to breathe's
    # C++ domain; nothing else in the C API is declared twice.
    "duplicate_declaration.cpp",
]

# ---- Python API ----
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
autosummary_generate = False  # the reference pages list their members themselves
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# Attributes as fields of their class: NamedTuple fields are documented once, not twice.
napoleon_use_ivar = True
nitpicky = False

# ---- C API: Doxygen XML from the public headers, rendered by breathe ----
HEADERS = ROOT / "csrc" / "include" / "gradient_accumulator"
DOXYGEN_XML = GENERATED / "doxygen" / "xml"
breathe_projects = {"gradient_accumulator": str(DOXYGEN_XML)}
breathe_default_project = "gradient_accumulator"
breathe_domain_by_extension = {"h": "cpp"}
breathe_default_members = ("members",)
cpp_id_attributes = ["GA_API"]
c_id_attributes = ["GA_API"]


def _run_doxygen() -> None:
    doxygen = shutil.which("doxygen")
    if doxygen is None:
        raise RuntimeError("the C API pages need Doxygen on PATH (apt-get install doxygen)")
    DOXYGEN_XML.parent.mkdir(parents=True, exist_ok=True)
    settings = {
        "PROJECT_NAME": "gradient_accumulator",
        "INPUT": str(HEADERS),
        "FILE_PATTERNS": "*.h",
        "OUTPUT_DIRECTORY": str(DOXYGEN_XML.parent),
        "GENERATE_XML": "YES",
        "GENERATE_HTML": "NO",
        "GENERATE_LATEX": "NO",
        "XML_OUTPUT": "xml",
        "EXTRACT_ALL": "YES",
        "ENABLE_PREPROCESSING": "YES",
        "MACRO_EXPANSION": "YES",
        "EXPAND_ONLY_PREDEF": "YES",
        "PREDEFINED": "GA_API= __cplusplus",
        "QUIET": "YES",
        "WARN_IF_UNDOCUMENTED": "NO",
        # Parameters left out of a \\param list are reported by review, not by the site build.
        "WARN_IF_INCOMPLETE_DOC": "NO",
        "WARN_AS_ERROR": "YES",
    }
    config = "\n".join(f"{k} = {v}" for k, v in settings.items())
    subprocess.run([doxygen, "-"], input=config.encode(), check=True, cwd=ROOT)


_run_doxygen()

# ---- Benchmark plots: read from benchmarks/README.md by docs/benchmark_plots.py ----
plot_working_directory = str(DOCS)
plot_include_source = False
plot_html_show_source_link = False
plot_html_show_formats = False
plot_formats = [("png", 110)]


# ---- Executed notebooks from the test run ----
def _use_executed_notebook(app, docname: str, source: list[str]) -> None:
    """Render the test run's executed copy of a tutorial, if it ran this very source."""
    folder = os.environ.get("GA_EXECUTED_NOTEBOOKS")
    if not folder or not docname.startswith("tutorials/"):
        return
    executed = pathlib.Path(folder) / (pathlib.PurePosixPath(docname).name + ".ipynb")
    if not executed.is_file():
        return
    mine, theirs = json.loads(source[0]), json.loads(executed.read_text(encoding="utf-8"))

    def code(nb: dict) -> list[str]:
        return ["".join(c["source"]) for c in nb["cells"]]

    if code(mine) == code(theirs):
        # Some code cells print nothing, so tell myst-nb not to run this copy again.
        theirs.setdefault("metadata", {})["mystnb"] = {"execution_mode": "off"}
        source[0] = json.dumps(theirs)


def setup(app):
    app.connect("source-read", _use_executed_notebook)
