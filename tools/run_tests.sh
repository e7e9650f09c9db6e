#!/usr/bin/env bash
# Runs the whole pytest suite against the installed package. Framework suites that need a fresh
# interpreter (one Keras backend per process) run in their own pytest process.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
# Import the installed package rather than the checkout (which has no compiled module in CI).
cd tests
python -m pytest -q -p no:cacheprovider --rootdir=.. -c ../pyproject.toml . "$@"
