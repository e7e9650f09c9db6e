#!/usr/bin/env bash
# cibuildwheel's before-all for the Linux wheels: the CUDA compiler and the static CUDA runtime
# (nothing else of the toolkit) from NVIDIA's RPM repository, plus cuBLAS's development package for
# cublasLt.h (the fused weight-gradient GEMM: the wheel dlopens libcublasLt at run time and links
# nothing of it; only the header is used), in the manylinux_2_28 image
# (AlmaLinux 8; x86_64, or aarch64 = NVIDIA's "sbsa" repository). The version is the one .ci/run
# builds with; the wheels link the runtime statically, so they need only an NVIDIA driver that
# supports it (CUDA 13.0: R580 or newer). cuobjdump lists the built module's architectures.
set -euo pipefail
version="${GA_CUDA_TOOLKIT_VERSION:-13.0}"
case "$(uname -m)" in
  x86_64) repo=x86_64 ;;
  aarch64) repo=sbsa ;;
  *) echo "no CUDA toolkit for $(uname -m)"; exit 1 ;;
esac
curl -fsSL -o /etc/yum.repos.d/cuda-rhel8.repo \
  "https://developer.download.nvidia.com/compute/cuda/repos/rhel8/${repo}/cuda-rhel8.repo"
v="${version/./-}"
dnf install -y -q "cuda-nvcc-${v}" "cuda-cudart-devel-${v}" "cuda-cuobjdump-${v}" \
  "libcublas-devel-${v}"
/usr/local/cuda-${version}/bin/nvcc --version | tail -1
