"""Keras distribution on JAX, 4 and 8 virtual CPU devices: ``DataParallel`` and ``ModelParallel``
(2 × 2 and 2 × 4 meshes, a LayoutMap sharding the kernels over "model") for both wrappers,
with AGC and with AccumBatchNormalization.

Every case trains to the weights of one device without distribution (the big batch; for batch
norm the same micro-batches) within 1e-6 of max|w|, and every accumulator — the wrapper's per
trainable variable, the batch norm's merged moments — is sharded exactly like its variable, so a
sharded kernel keeps a sharded accumulator (no replicated copy, no gather).

The cases run in one child interpreter (jax_mesh_worker.py): the number of host devices is fixed
when JAX is imported, and this process has two.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from keras_helpers import BACKEND

if BACKEND != "jax":
    pytest.skip("Keras's distribution API is JAX's", allow_module_level=True)

import gradient_accumulator  # noqa: E402

WORKER = Path(__file__).with_name("jax_mesh_worker.py")
CASES = (
    "model-dp4",
    "model-mp4",
    "model-mp8-agc",
    "model-dp8-bn",
    "optimizer-dp8",
    "optimizer-mp8",
    "optimizer-mp4-agc",
    "optimizer-mp8-bn",
)
# fp32 against fp32 on one device; measured 4e-9 to 2e-7.
TOL = 1e-6


@pytest.fixture(scope="module")
def results() -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["KERAS_BACKEND"] = "jax"
    # The package this process imported (the installed one in CI, the checkout's in development).
    package_root = str(Path(gradient_accumulator.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([package_root, env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    proc = subprocess.run(
        [sys.executable, str(WORKER), *CASES],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES)
def test_matches_one_device(results, case):
    result = results[case]
    assert result["rel"] <= TOL, result["rel"]
    # 64 samples, 2 epochs, 4 micro-batches of 8 per update.
    assert result["iterations"] == 4


@pytest.mark.parametrize("case", CASES)
def test_accumulators_are_sharded_like_their_variables(results, case):
    layouts = results[case]["layouts"]
    expected = 4 + (2 + 2 if "bn" in case else 0)  # kernels and biases (+ gamma, beta; moments)
    assert len(layouts) == expected
    for entry in layouts:
        assert entry["same"], entry
        assert entry["shard_shape"] == entry["variable_shard_shape"], entry
    sharded = [e["variable"] for e in layouts if e["sharded"]]
    if "-mp" in case:
        # The hidden kernel and bias and the output kernel (and batch norm's four vectors).
        assert len(sharded) == (7 if "bn" in case else 3), sharded
    else:
        assert sharded == []
