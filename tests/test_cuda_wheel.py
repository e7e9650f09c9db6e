"""The Linux wheel's CUDA kernels: which GPUs they are for, what the module links, how big it is.

The architectures are written once, in CMakeLists.txt (GA_CUDA_RELEASE_ARCHITECTURES): the
release configuration leaves them to CMake, the docs name the same list, and the module in the
wheel that .ci/run builds (``GA_WHEEL``) holds exactly that machine code and PTX, as cuobjdump
lists it (pip package ``nvidia-cuda-cuobjdump``; skipped without it). Whatever the build, the
module needs no CUDA library to load (the runtime is linked statically, the driver is found at
run time), and the wheel stays under 60 MB.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python < 3.11
    tomllib = pytest.importorskip("tomli")

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_WHEEL_BYTES = 60 * 1000 * 1000


def release_architectures() -> list[str]:
    """CMake's list, e.g. ["75-real", ..., "120-virtual"]."""
    cmake = (ROOT / "CMakeLists.txt").read_text(encoding="utf-8")
    found = re.findall(r"^\s*set\(GA_CUDA_RELEASE_ARCHITECTURES ([^)]*)\)", cmake, re.M)
    assert len(found) == 1, "GA_CUDA_RELEASE_ARCHITECTURES is set once"
    return found[0].split()


def release_sass_and_ptx() -> tuple[list[int], list[int]]:
    sass, ptx = [], []
    for arch in release_architectures():
        number, kind = re.fullmatch(r"(\d+)-(real|virtual)", arch).groups()
        (sass if kind == "real" else ptx).append(int(number))
    return sass, ptx


def documented_sentence() -> str:
    """How the docs name the list: "SASS for sm_75, ..., sm_120 and PTX for compute_120"."""
    sass, ptx = release_sass_and_ptx()
    return "SASS for {} and PTX for {}".format(
        ", ".join(f"sm_{a}" for a in sass), ", ".join(f"compute_{a}" for a in ptx)
    )


def test_release_architectures_are_the_issue_list_and_documented():
    sass, ptx = release_sass_and_ptx()
    assert sass == [75, 80, 86, 89, 90, 100, 120]
    assert ptx == [max(sass)]  # PTX of the newest, for GPUs after it
    sentence = documented_sentence()
    for doc in ("docs/building.md", "docs/cuda.md"):
        text = " ".join((ROOT / doc).read_text(encoding="utf-8").split())
        assert sentence in text, f"{doc} does not say: {sentence}"


def test_release_configuration_builds_the_cuda_wheel_with_cmakes_list():
    """cibuildwheel's Linux table installs nvcc, requires the kernels and names no other list;
    macOS and Windows stay CPU wheels."""
    cibw = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"][
        "cibuildwheel"
    ]
    linux = cibw["linux"]
    assert linux["environment"]["GA_CUDA"] == "ON"
    assert "CUDAARCHS" not in linux["environment"]
    assert "CMAKE_CUDA_ARCHITECTURES" not in str(cibw)
    assert "install_cuda_manylinux.sh" in linux["before-all"]
    assert linux["test-command"].endswith("--expect-cuda")
    assert cibw["environment"]["GA_CUDA"] == "OFF"  # Windows (the default table)
    assert cibw["macos"]["environment"]["GA_CUDA"] == "OFF"
    # The toolkit the script installs is the one CUDACXX names.
    script = (ROOT / "tools" / "install_cuda_manylinux.sh").read_text(encoding="utf-8")
    version = re.search(r'version="\$\{GA_CUDA_TOOLKIT_VERSION:-([\d.]+)\}"', script).group(1)
    assert linux["environment"]["CUDACXX"] == f"/usr/local/cuda-{version}/bin/nvcc"
    # .ci/run builds the release list too: it names no architectures of its own.
    assert "CUDAARCHS" not in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


# ---- the built wheel (GA_WHEEL, which .ci/run sets) ----


def _wheel() -> pathlib.Path:
    path = os.environ.get("GA_WHEEL")
    if not path:
        pytest.skip("GA_WHEEL names no built wheel (.ci/run sets it)")
    return pathlib.Path(path)


@pytest.fixture(scope="module")
def module(tmp_path_factory) -> pathlib.Path:
    """The wheel's compiled module, extracted."""
    wheel = _wheel()
    if not wheel.name.endswith(("linux_x86_64.whl", "linux_aarch64.whl")):
        pytest.skip(f"not a Linux wheel: {wheel.name}")
    out = tmp_path_factory.mktemp("wheel")
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if re.fullmatch(r"gradient_accumulator/_C\..*so", n)]
        zf.extract(name, out)
    return out / name


def _has_fatbin(so: pathlib.Path) -> bool:
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("needs readelf (binutils)")
    sections = subprocess.run([readelf, "-SW", str(so)], capture_output=True, text=True).stdout
    return ".nv_fatbin" in sections


def _cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    nvcc = shutil.which("nvcc")
    if nvcc and (pathlib.Path(nvcc).resolve().parent / "cuobjdump").is_file():
        return str(pathlib.Path(nvcc).resolve().parent / "cuobjdump")
    spec = importlib.util.find_spec("nvidia")  # pip: nvidia-cuda-cuobjdump
    for base in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("cu13", "cuda_cuobjdump", "cu12"):
            cand = pathlib.Path(base) / sub / "bin" / "cuobjdump"
            if cand.is_file() and os.access(cand, os.X_OK):
                return str(cand)
    return None


def test_wheel_module_holds_the_release_architectures(module):
    """cuobjdump lists the machine code (ELF) and PTX images of every object file in the module:
    together they are exactly the release list, the same in every one of the op families."""
    if not _has_fatbin(module):
        if os.environ.get("GA_WHEEL_HAS_CUDA") == "1":
            pytest.fail("the wheel was built with CUDA kernels, but its module has no fatbin")
        pytest.skip("this wheel has no CUDA kernels (built without nvcc)")
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("needs cuobjdump (pip install nvidia-cuda-cuobjdump)")
    listed = {}
    for kind in ("elf", "ptx"):
        out = subprocess.run(
            [tool, f"--list-{kind}", str(module)], capture_output=True, text=True, check=True
        ).stdout
        names = re.findall(r"^(?:ELF|PTX) file\s+\d+: (\S+)$", out, re.M)
        listed[kind] = sorted({int(re.search(r"\.sm_(\d+)[a-z]?\.", n).group(1)) for n in names})
        per_arch = {a: sum(f".sm_{a}." in n for n in names) for a in listed[kind]}
        assert len(set(per_arch.values())) == 1, per_arch  # every object has every arch
        print(f"{kind}: {len(names)} images, sm_{listed[kind]}")
    sass, ptx = release_sass_and_ptx()
    assert listed["elf"] == sass
    assert listed["ptx"] == ptx


def test_wheel_module_links_no_cuda_library(module):
    """Only the C and C++ runtime libraries (and OpenMP's) are NEEDED: no libcuda (the driver,
    which the static runtime opens at run time), no libcudart, no CUDA math library. So the
    module imports and runs its CPU ops where no CUDA is installed."""
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("needs readelf (binutils)")
    dynamic = subprocess.run(
        [readelf, "-dW", str(module)], capture_output=True, text=True, check=True
    ).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic)
    assert needed, dynamic
    allowed = r"(libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s|libgomp|ld-linux.*)"
    allowed += r"(-[0-9a-f]{8})?\.so(\.[\d.]+)?"  # auditwheel renames the libraries it grafts
    assert [n for n in needed if not re.fullmatch(allowed, n)] == [], needed
    assert not [n for n in needed if re.search(r"cuda|cublas|nvrtc|nvjitlink", n)]


def test_wheel_is_under_60_mb():
    wheel = _wheel()
    size = wheel.stat().st_size
    with zipfile.ZipFile(wheel) as zf:
        unpacked = sum(i.file_size for i in zf.infolist())
    print(f"{wheel.name}: {size / 1e6:.1f} MB, {unpacked / 1e6:.1f} MB unpacked")
    assert size < MAX_WHEEL_BYTES
