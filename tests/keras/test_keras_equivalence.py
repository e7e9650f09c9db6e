"""k micro-batches of b give the weights of one batch of k·b, for both wrappers and any optimizer.

Every run uses a learning-rate schedule that decays at each update, so a schedule (or a bias
correction) counting micro-steps instead of updates fails the comparison. The reference is a
plain ``keras.Model`` trained with the big batch; with AGC it clips the big-batch gradient.
"""

from __future__ import annotations

import functools

import pytest
from keras_helpers import (
    BACKEND,
    OPTIMIZERS,
    TOL,
    rel_diff,
    train_accumulated,
    train_big_batch,
)

ACCUM, MICRO = 4, 4
# On the PyTorch backend the optimizer wrapper runs through the C++ core by default; "ops" forces
# the backend-ops path, so both paths meet the same expectations.
WRAPPERS = ["model", "optimizer"] + (["optimizer-ops"] if BACKEND == "torch" else [])


@functools.cache
def reference(name: str, use_agc: bool):
    return train_big_batch(name, use_agc, ACCUM, MICRO)


@pytest.mark.parametrize("use_agc", [False, True], ids=["plain", "agc"])
@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_weights_match_big_batch(wrapper, name, use_agc):
    use_core = False if wrapper == "optimizer-ops" else None
    got, model = train_accumulated(
        wrapper.split("-")[0], name, use_agc, ACCUM, MICRO, use_core=use_core
    )
    assert rel_diff(got, reference(name, use_agc)) <= TOL
    # 64 samples, 2 epochs: 8 updates of the inner optimizer, 32 micro-steps.
    assert int(model.optimizer.iterations) == 8
    assert int(model.optimizer.micro_steps) == 32


@pytest.mark.parametrize("name", ["SGD", "Adam"])
def test_agc_changes_the_result(name):
    """The AGC cases above would pass vacuously if clipping never bit: it does."""
    assert rel_diff(reference(name, True), reference(name, False)) > 1e-3


@pytest.mark.parametrize("accum", [2, 4])
def test_optimizer_wrapper_steps(accum):
    """The original's test_optimizer_wrapper: bs·k×1 vs bs×k for k = 2 and 4 (SGD)."""
    micro = 16 // accum
    got, _ = train_accumulated("optimizer", "SGD", False, accum, micro)
    assert rel_diff(got, reference("SGD", False)) <= TOL
