"""Every cycle starts from zeroed accumulators, whatever ended the last one.

TensorFlow's step adds a micro-batch onto the accumulators without looking at the micro-step
(no overwrite at a cycle's first micro-step), so every way a cycle ends or is discarded must
leave them at zero: a boundary, a non-finite cycle dropped, a flush, ``reset_cycle``, and a load
of a file whose accumulators still hold the last cycle's sums at micro-step 0 (as the JAX and
torch backends' files do, whose folds overwrite instead). Each scenario is compared with a fresh
optimizer given the same cycle; on every backend.
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
from keras_helpers import BACKEND

from gradient_accumulator.keras import GradientAccumulateOptimizer
from gradient_accumulator.nonfinite import NonFiniteGradientWarning

SHAPES = [(4, 3), (3,)]
K = 3


def _grads(seed):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=s).astype("float32") for s in SHAPES]


def _fresh(accum_steps=K, **kwargs):
    variables = [keras.Variable(np.full(s, 0.5, "float32")) for s in SHAPES]
    opt = GradientAccumulateOptimizer(keras.optimizers.Adam(0.1), accum_steps, **kwargs)
    opt.build(variables)
    return opt, variables


def _apply(opt, variables, seed, weight=None):
    """One micro-batch: the gradients of ``seed`` (or ``seed`` itself, a list of arrays)."""
    arrays = _grads(seed) if isinstance(seed, int) else seed
    grads = [keras.ops.convert_to_tensor(g) for g in arrays]
    if BACKEND == "tensorflow":
        import tensorflow as tf

        # The compiled step, as fit runs it (one function per optimizer and kind of call).
        if weight is None:
            step = opt.__dict__.setdefault(
                "_test_step", tf.function(lambda g: opt.apply(g, variables))
            )
            step(grads)
        else:
            step = opt.__dict__.setdefault(
                "_test_weighted_step", tf.function(lambda g, w: opt.apply(g, variables, weight=w))
            )
            step(grads, tf.constant(weight, "float32"))
    else:
        opt.apply(grads, variables, weight=weight)


def _state(opt, variables):
    return [np.asarray(v.numpy()) for v in variables] + [
        np.asarray(v.numpy()) for v in opt.optimizer.variables
    ]


def _reference(seeds):
    """A fresh optimizer given one whole cycle of ``seeds``."""
    opt, variables = _fresh()
    for seed in seeds:
        _apply(opt, variables, seed)
    return _state(opt, variables)


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def _accumulators(opt):
    return [np.asarray(keras.ops.convert_to_numpy(a.value)) for a in opt.accumulators]


def test_accumulators_are_zero_after_a_boundary_on_tensorflow():
    opt, variables = _fresh()
    for seed in range(K):
        _apply(opt, variables, seed)
    assert int(opt.counter("micro_step").numpy()) == 0
    assert int(opt.optimizer.iterations.numpy()) == 1
    if BACKEND == "tensorflow":  # the other backends overwrite at a cycle's first micro-step
        assert all(not a.any() for a in _accumulators(opt))


def test_a_dropped_non_finite_cycle_leaves_nothing_behind():
    """A cycle with an Inf is dropped (``on_nonfinite="skip"``); the next cycle is exact."""
    opt, variables = _fresh()
    _apply(opt, variables, 0)
    bad = _grads(1)
    bad[0][0, 0] = np.inf
    _apply(opt, variables, bad)
    with warnings.catch_warnings():  # reported where the step runs eagerly: not the point here
        warnings.simplefilter("ignore", NonFiniteGradientWarning)
        _apply(opt, variables, 2)
    assert int(keras.ops.convert_to_numpy(opt.counter("skipped").value)) == 1
    assert int(opt.optimizer.iterations.numpy()) == 0
    for seed in (3, 4, 5):
        _apply(opt, variables, seed)
    _assert_same(_state(opt, variables), _reference((3, 4, 5)))


def test_flush_then_a_whole_cycle_is_exact():
    opt, variables = _fresh()
    _apply(opt, variables, 0)
    _apply(opt, variables, 1)
    assert opt.flush()
    flushed = _state(opt, variables)
    for seed in (3, 4, 5):
        _apply(opt, variables, seed)
    # The reference: the same flushed start, then the cycle in a fresh optimizer's cycle.
    ref, ref_vars = _fresh()
    _apply(ref, ref_vars, 0)
    _apply(ref, ref_vars, 1)
    ref.flush()
    _assert_same(_state(ref, ref_vars), flushed)
    ref.reset_cycle()
    for seed in (3, 4, 5):
        _apply(ref, ref_vars, seed)
    _assert_same(_state(opt, variables), _state(ref, ref_vars))


def test_reset_cycle_discards_the_pending_sums():
    opt, variables = _fresh()
    _apply(opt, variables, 0)
    _apply(opt, variables, 1)
    opt.reset_cycle()
    for seed in (3, 4, 5):
        _apply(opt, variables, seed)
    _assert_same(_state(opt, variables), _reference((3, 4, 5)))


def test_a_loaded_file_with_the_last_cycles_sums_at_micro_step_zero():
    """A file saved between cycles by a backend whose fold overwrites holds the last cycle's
    sums in its accumulators; after loading it, the next cycle is exact."""
    opt, variables = _fresh()
    _apply(opt, variables, 0)
    _apply(opt, variables, 1)
    # Such a file, written here: sums and their weight left, the micro-step at 0 (reset_cycle
    # would zero them; the counter is written directly, as a file would hold it).
    opt.counter("micro_step").assign(0)
    assert any(a.any() for a in _accumulators(opt))
    store = {}
    opt.save_own_variables(store)
    loaded, loaded_vars = _fresh()
    loaded.load_own_variables(store)
    for seed in (3, 4, 5):
        _apply(loaded, loaded_vars, seed)
    _assert_same(_state(loaded, loaded_vars), _reference((3, 4, 5)))


@pytest.mark.parametrize("reduction", ["MEAN", "RUNNING_MEAN", "SUM"])
def test_weighted_cycles_in_a_row_match_eager_ones(reduction):
    """Three cycles in a row with uneven weights (none under ``"SUM"``), compiled: the same as
    run eagerly, call by call (no sum or weight carried over from the cycle before)."""

    def weight(cycle, j):
        return None if reduction == "SUM" else float(j + 1 + cycle)

    opt, variables = _fresh(reduction=reduction)
    for cycle in range(3):
        for j in range(K):
            _apply(opt, variables, 10 * cycle + j, weight=weight(cycle, j))
    ref, ref_vars = _fresh(reduction=reduction)
    for cycle in range(3):
        for j in range(K):
            grads = [keras.ops.convert_to_tensor(g) for g in _grads(10 * cycle + j)]
            ref.apply(grads, ref_vars, weight=weight(cycle, j))
    _assert_same(_state(opt, variables), _state(ref, ref_vars))
