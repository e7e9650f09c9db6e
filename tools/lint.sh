#!/usr/bin/env bash
# Style gates: ruff lint, ruff format and clang-format over the whole tree, in check mode (nothing
# is rewritten). Run by .ci/run and by the GitHub lint job, with the versions pinned in
# requirements-lint.txt, so the two cannot disagree. To fix what it reports:
#   ruff check --fix . && ruff format .
#   git ls-files -z -- '*.h' '*.c' '*.cc' '*.cpp' '*.cu' '*.cuh' '*.inc' | xargs -0 clang-format -i
set -euo pipefail
cd "$(dirname "$0")/.."
ruff --version
ruff check .
ruff format --check .
clang-format --version
# Every tracked C, C++ and CUDA source of the core, its tests and the bindings.
git ls-files -z -- '*.h' '*.c' '*.cc' '*.cpp' '*.cu' '*.cuh' '*.inc' \
  | xargs -0 clang-format --dry-run -Werror
echo "style gates: clean"
