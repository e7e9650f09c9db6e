"""Release checks: one version everywhere, and what the wheel and the sdist hold.

The wheel and sdist checks read the artifacts named by ``GA_WHEEL`` / ``GA_SDIST`` (set by
``.ci/run``, which builds them with ``python -m build`` and runs the tests against that wheel).
"""

from __future__ import annotations

import email
import importlib.metadata
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
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


def _cibuildwheel() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"][
        "cibuildwheel"
    ]


def test_wheel_test_command_runs_test_files_that_exist():
    """cibuildwheel tests every wheel with tools/wheel_test.py, which copies the core's test
    files named there; a renamed file would break only the release workflow."""
    assert _cibuildwheel()["test-command"] == "python {project}/tools/wheel_test.py {project}"
    assert _cibuildwheel()["linux"]["test-command"] == (
        "python {project}/tools/wheel_test.py {project} --expect-cuda"
    )
    spec = importlib.util.spec_from_file_location("wheel_test", ROOT / "tools" / "wheel_test.py")
    wheel_test = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wheel_test)
    assert len([f for f in wheel_test.FILES if f.startswith("test_core_")]) >= 5
    missing = [f for f in wheel_test.FILES if not (ROOT / "tests" / f).is_file()]
    assert not missing, f"tools/wheel_test.py names missing files: {missing}"


# ---- the release wheel's own test, run as cibuildwheel runs it ----

#: The oldest NumPy that pyproject allows with a wheel for each Python (numpy>=1.22).
OLDEST_NUMPY = {
    (3, 9): "1.22.0",
    (3, 10): "1.22.0",
    (3, 11): "1.23.2",
    (3, 12): "1.26.0",
    (3, 13): "2.1.0",
}


def _clean_env() -> dict:
    """This environment without what would make another venv see this one's packages."""
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONUSERBASE")
    return {k: v for k, v in os.environ.items() if k not in drop}


def _venv(path: pathlib.Path, python: str) -> pathlib.Path:
    """A plain virtual environment (no system site-packages); returns its bin folder."""
    subprocess.run([python, "-m", "venv", str(path)], check=True)
    return path / ("Scripts" if os.name == "nt" else "bin")


def _pip(bindir: pathlib.Path, *args: str) -> None:
    pip = [str(bindir / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, *args], check=True, env=_clean_env())


def _test_command(cuda: bool) -> str:
    """cibuildwheel's test-command: the Linux one (which requires the CUDA kernels) for a wheel
    with them, else the default one."""
    cibw = _cibuildwheel()
    return cibw["linux"]["test-command"] if cuda else cibw["test-command"]


def _run_wheel_test_command(
    bindir: pathlib.Path, cwd: pathlib.Path, cuda: bool | None = None
) -> tuple[str, dict]:
    """cibuildwheel's test-command, {project} substituted, through a shell with ``bindir``'s
    ``python`` first on PATH, from a folder outside the source tree (as cibuildwheel does).
    ``cuda``: whether the wheel has the CUDA kernels (default: whether .ci/run built it so)."""
    if cuda is None:
        cuda = os.environ.get("GA_WHEEL_HAS_CUDA") == "1"
    command = _test_command(cuda).replace("{project}", str(ROOT))
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    if bindir != pathlib.Path(sys.executable).parent:  # a clean venv: nothing from outside
        env = dict(_clean_env(), PATH=env["PATH"])
    proc = subprocess.run(
        command, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=1200
    )
    out = proc.stdout + proc.stderr
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)}
    assert proc.returncode == 0, out[-6000:]
    return out, counts


def _probe(bindir: pathlib.Path, code: str) -> str:
    """What ``code`` prints in the venv, run from a folder of its own with a clean environment."""
    env = _clean_env()
    return subprocess.run(
        [str(bindir / "python"), "-c", code],
        check=True, capture_output=True, text=True, cwd=bindir, env=env,
    ).stdout.strip()  # fmt: skip


@pytest.mark.slow
def test_wheel_test_command_passes_in_a_clean_venv_without_frameworks(tmp_path):
    """The release test of every wheel: the wheel and cibuildwheel's test-requires in a fresh
    venv (no torch, no Keras), then exactly its test-command. The torch cases skip."""
    wheel = _artifact("GA_WHEEL")
    bindir = _venv(tmp_path / "venv", sys.executable)
    _pip(bindir, str(wheel), *_cibuildwheel()["test-requires"])
    assert _probe(bindir, "import importlib.util as u; print(u.find_spec('torch'))") == "None"
    assert _probe(bindir, "import importlib.util as u; print(u.find_spec('keras'))") == "None"
    out, counts = _run_wheel_test_command(bindir, tmp_path)
    assert counts.get("failed", 0) == 0 and counts.get("errors", counts.get("error", 0)) == 0
    assert counts.get("passed", 0) >= 300, out[-3000:]
    assert counts.get("skipped", 0) >= 100, out[-3000:]  # the torch cases
    assert "could not import 'torch'" in out
    # The CUDA build of the Linux wheels: kernels in, no CUDA library needed to import, and on a
    # machine without a driver or GPU a reason that says so (not "rebuild with GA_CUDA=ON").
    status = _probe(
        bindir,
        "from gradient_accumulator import core; s = core.cuda_status(); "
        "print(core.has_cuda(), s.available, s.reason, sep='|')",
    )
    has_cuda, available, reason = status.split("|", 2)
    if os.environ.get("GA_WHEEL_HAS_CUDA") in ("0", "1"):  # .ci/run says which it built
        assert has_cuda == str(os.environ["GA_WHEEL_HAS_CUDA"] == "1"), status
    if has_cuda == "True":
        assert "CUDA kernels: True" in out
        assert "GA_CUDA" not in reason, status
        assert available == str(reason.startswith("ok: ")), status
    else:
        assert reason == "no CUDA kernels in this build (GA_CUDA=OFF)", status


@pytest.mark.slow
def test_wheel_test_command_passes_with_torch_installed(tmp_path):
    """The same command where torch is installed (this environment, which holds the wheel):
    the torch cases run and pass too."""
    pytest.importorskip("torch")
    wheel = _artifact("GA_WHEEL")
    try:
        dist = importlib.metadata.distribution("gradient-accumulator")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the package is imported from a checkout, not installed from GA_WHEEL")
    assert dist.version in wheel.name
    out, counts = _run_wheel_test_command(pathlib.Path(sys.executable).parent, tmp_path)
    assert counts.get("failed", 0) == 0
    assert counts.get("passed", 0) >= 400, out[-3000:]
    assert "could not import 'torch'" not in out


def _oldest_python() -> str:
    """The oldest Python the package supports, where this machine has one that runs
    (GA_OLDEST_PYTHON, which .ci/run sets, else python3.9 on PATH), else the running one."""
    for candidate in (os.environ.get("GA_OLDEST_PYTHON"), shutil.which("python3.9")):
        if candidate and subprocess.run([candidate, "-c", ""], capture_output=True).returncode == 0:
            return candidate
    return sys.executable


@pytest.mark.slow
def test_oldest_numpy_and_python_pass_the_wheel_test(tmp_path):
    """numpy>=1.22 is what pyproject allows: the oldest NumPy with a wheel for the oldest Python
    here, in a clean venv with a wheel built for that Python, passes the same test command
    (numpy before 2.1 exports no read-only array through DLPack; read-only inputs must still
    be accepted)."""
    python = _oldest_python()
    bindir = _venv(tmp_path / "venv", python)
    probe = _probe(bindir, "import sys; print(*sys.version_info[:2])")
    version = tuple(int(v) for v in probe.split())
    numpy = OLDEST_NUMPY[version]
    cuda = None  # the wheel .ci/run built: with CUDA kernels where it says so
    if version == sys.version_info[:2]:
        wheel = _artifact("GA_WHEEL")
    else:  # a wheel for that Python, built from the sdist (CPU core only)
        cuda = False
        sdist = _artifact("GA_SDIST")
        subprocess.run(
            [str(bindir / "python"), "-m", "pip", "wheel", "-q", "--no-deps", "-w",
             str(tmp_path / "dist"), str(sdist)],
            check=True, env=dict(_clean_env(), GA_CUDA="OFF"),
        )  # fmt: skip
        wheel = next((tmp_path / "dist").glob("*.whl"))
    requires = [r for r in _cibuildwheel()["test-requires"] if not r.startswith("numpy")]
    _pip(bindir, str(wheel), f"numpy=={numpy}", *requires)
    assert _probe(bindir, "import numpy; print(numpy.__version__)") == numpy
    out, counts = _run_wheel_test_command(bindir, tmp_path, cuda)
    assert counts.get("failed", 0) == 0
    assert counts.get("passed", 0) >= 300, out[-3000:]


# ---- the Windows build (MSVC) ----

CORE = ROOT / "csrc" / "core"


def _preprocessed_project_lines(cxx: str, source: pathlib.Path, *flags: str) -> list[str]:
    """The lines of ``source`` and the project's own headers after preprocessing."""
    out = subprocess.run(
        [cxx, "-std=c++17", "-E", "-fopenmp", *flags, f"-I{ROOT / 'csrc' / 'include'}",
         f"-I{CORE}", str(source)],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    lines, ours = [], False
    for line in out.splitlines():
        marker = re.match(r'# \d+ "([^"]+)"', line)
        if marker:
            ours = str(ROOT / "csrc") in str(pathlib.Path(marker.group(1)).resolve())
        elif ours:
            lines.append(line)
    return lines


def test_core_has_msvc_paths_without_omp_simd_or_gcc_builtins():
    """Windows wheels are compiled by MSVC, whose default /openmp (OpenMP 2.0) rejects
    ``#pragma omp simd`` as an error and which has no ``__builtin_*`` functions. Under
    GA_MSVC_COMPAT (defined for MSVC) the core must use neither: preprocessed here with g++, the
    project's lines hold none, while the default build keeps the simd pragmas."""
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no g++ or clang++ on PATH")
    for source in sorted(CORE.glob("*.cc")):
        default = "\n".join(_preprocessed_project_lines(cxx, source))
        msvc = "\n".join(_preprocessed_project_lines(cxx, source, "-DGA_MSVC_COMPAT"))
        assert "omp simd" not in msvc, source.name
        assert "__builtin_" not in msvc, source.name
        if source.name.startswith("kernels_"):
            assert "#pragma omp simd" in default, source.name  # the guard keeps them elsewhere
    raw = [
        f"{p.name}:{n}"
        for p in sorted(ROOT.glob("csrc/*/*"))
        if p.suffix in (".cc", ".h", ".inc")
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if re.match(r"\s*#\s*pragma\s+omp\s+simd", line)
    ]
    assert not raw, f"a bare '#pragma omp simd' (use GA_OMP_SIMD): {raw}"


def test_portable_overflow_checks_agree_with_the_builtins(tmp_path):
    """The MSVC overflow checks, compiled and run here, against GCC's builtins on the edges."""
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no g++ or clang++ on PATH")
    source = tmp_path / "overflow.cc"
    source.write_text(
        textwrap.dedent(
            """
            #include <cstdio>
            #include <limits>
            #include "internal.h"
            int main() {
              const int64_t big = std::numeric_limits<int64_t>::max();
              const int64_t small = std::numeric_limits<int64_t>::min();
              const int64_t v[] = {0, 1, -1, 2, -2, 3037000499, 3037000500, -3037000500,
                                   big, small, big / 2, small / 2, big - 1, small + 1};
              int bad = 0, n = 0;
              for (int64_t a : v)
                for (int64_t b : v) {
                  int64_t r1 = 0, r2 = 0;
                  bool o1 = ga::detail::mul_overflows(a, b, &r1);
                  bool o2 = __builtin_mul_overflow(a, b, &r2);
                  bad += o1 != o2 || (!o1 && r1 != r2);
                  o1 = ga::detail::add_overflows(a, b, &r1);
                  o2 = __builtin_add_overflow(a, b, &r2);
                  bad += o1 != o2 || (!o1 && r1 != r2);
                  n += 2;
                }
              std::printf("%d of %d differ\\n", bad, n);
              return bad != 0;
            }
            """
        ),
        encoding="utf-8",
    )
    exe = tmp_path / "overflow"
    subprocess.run(
        [cxx, "-std=c++17", "-O1", "-DGA_MSVC_COMPAT", f"-I{ROOT / 'csrc' / 'include'}",
         f"-I{CORE}", str(source), "-o", str(exe)],
        check=True,
    )  # fmt: skip
    proc = subprocess.run([str(exe)], capture_output=True, text=True)
    assert proc.stdout.strip() == "0 of 392 differ", proc.stdout


def test_release_workflow_builds_each_architecture_on_its_own_runner():
    """cibuildwheel builds Linux aarch64 on x86_64 only under QEMU: every wheel job names one
    architecture (CIBW_ARCHS) that its runner has natively, or sets up QEMU."""
    yaml = pytest.importorskip("yaml")
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "release.yml").read_text("utf-8"))
    job = workflow["jobs"]["wheels"]
    steps = job["steps"]
    cibw = next(s for s in steps if str(s.get("uses", "")).startswith("pypa/cibuildwheel"))
    qemu = any("setup-qemu-action" in str(s.get("uses", "")) for s in steps)
    assert cibw.get("env", {}).get("CIBW_ARCHS") == "${{ matrix.arch }}" or qemu
    native = {"ubuntu-24.04": "x86_64", "ubuntu-24.04-arm": "aarch64", "macos-14": "arm64"}
    native["windows-2022"] = "AMD64"
    entries = job["strategy"]["matrix"]["include"]
    assert {e["arch"] for e in entries} == {"x86_64", "aarch64", "arm64", "AMD64"}
    for entry in entries:
        assert qemu or native[entry["os"]] == entry["arch"], entry
    # pyproject's default for Linux is the runner's own architecture, not both.
    assert _cibuildwheel()["linux"]["archs"] == ["auto64"]
