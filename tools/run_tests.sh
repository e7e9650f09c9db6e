#!/usr/bin/env bash
# Runs the whole pytest suite against the installed package: the core and PyTorch tests in one
# process, then the Keras tests once per backend, each in a fresh interpreter (Keras fixes its
# backend at import). Any failing process, or one that collects no test, fails the run.
#
# The processes run in two lanes side by side when the machine has two cores or more (most of
# the suite is single-threaded Python and tracing, so two lanes finish in about two thirds of the
# serial time on a 2-core machine); GA_TEST_LANES=1 runs them one after another, as before. Each
# lane's output goes to build/test-logs/<lane>.log and is printed when the lane ends.
# Usage: tools/run_tests.sh [extra pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
logs="$PWD/build/test-logs"
# Import the installed package rather than the checkout (which has no compiled module in CI).
cd tests
run() { python -m pytest -q -p no:cacheprovider --rootdir=.. -c ../pyproject.toml "$@"; }

# The Keras files that build tf.distribute strategies run in interpreters of their own: on
# TensorFlow, strategies over the same devices in one process can pair one model's collectives
# with another's (each file passes alone; together they failed with InvalidArgumentError).
own_process=(keras/test_keras_cycle_fidelity.py keras/test_original_suite.py)
keras_main() {
  echo "== Keras tests, KERAS_BACKEND=$1 =="
  KERAS_BACKEND=$1 run keras "${own_process[@]/#/--ignore=}" "${@:2}"
}
keras_own() {
  local file
  for file in "${own_process[@]}"; do
    echo "== Keras tests, KERAS_BACKEND=$1: $file =="
    KERAS_BACKEND=$1 run "$file" "${@:2}" || return  # set -e is off in an && chain
  done
}

# Lanes balanced by their times side by side on a 2-core machine (minutes, 2026-11-27):
# TensorFlow's main part (~19) with the torch backend (~4); the core and PyTorch tests (~10)
# with JAX (~10) and TensorFlow's own-process files (~2).
lane_a() { keras_main tensorflow "$@" && keras_main torch "$@" && keras_own torch "$@"; }
lane_b() {
  echo "== core and PyTorch tests =="
  run . --ignore=keras "$@" && keras_main jax "$@" && keras_own jax "$@" \
    && keras_own tensorflow "$@"
}

lanes=${GA_TEST_LANES:-$(( $(nproc) >= 2 ? 2 : 1 ))}
case "$lanes" in
  1 | 2) ;;
  *) echo "GA_TEST_LANES must be 1 or 2, got '$lanes'" >&2; exit 2 ;;
esac
if [ "$lanes" -eq 1 ]; then
  lane_b "$@"
  lane_a "$@"
  exit 0
fi
rm -rf "$logs"
mkdir -p "$logs"
trap 'kill $(jobs -p) 2>/dev/null || true' INT TERM  # stopped: the lanes stop too
start=$SECONDS
( set -e; lane_a "$@" ) > "$logs/a.log" 2>&1 &
pid_a=$!
( set -e; lane_b "$@" ) > "$logs/b.log" 2>&1 &
pid_b=$!
echo "pytest in two lanes (logs in $logs): a = TensorFlow + torch backends, b = core/PyTorch + JAX"
status=0
for lane in b a; do
  pid_var="pid_$lane"
  if wait "${!pid_var}"; then rc=0; else rc=$?; fi
  echo "== lane $lane ended with status $rc after $(( SECONDS - start )) s =="
  cat "$logs/$lane.log"
  [ "$rc" -eq 0 ] || status=$rc
done
exit "$status"
