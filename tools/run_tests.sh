#!/usr/bin/env bash
# Runs the whole pytest suite against the installed package: the core and PyTorch tests in one
# process, then the Keras tests once per backend, each in a fresh interpreter (Keras fixes its
# backend at import). Any failing process, or one that collects no test, fails the run.
# Usage: tools/run_tests.sh [extra pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
# Import the installed package rather than the checkout (which has no compiled module in CI).
cd tests
run() { python -m pytest -q -p no:cacheprovider --rootdir=.. -c ../pyproject.toml "$@"; }
run . --ignore=keras "$@"
for backend in torch jax tensorflow; do
  echo "== Keras tests, KERAS_BACKEND=$backend =="
  # The files that build tf.distribute strategies run in interpreters of their own: on TensorFlow,
  # strategies over the same devices in one process can pair one model's collectives with
  # another's (each file passes alone; together they failed with InvalidArgumentError).
  KERAS_BACKEND=$backend run keras --ignore=keras/test_keras_cycle_fidelity.py \
    --ignore=keras/test_original_suite.py "$@"
  KERAS_BACKEND=$backend run keras/test_keras_cycle_fidelity.py "$@"
  KERAS_BACKEND=$backend run keras/test_original_suite.py "$@"
done
