"""The shared cycle table (tests/cycle_table.py) through the Keras wrapper on this backend.

On the torch backend both paths run: the C++ core on torch tensors and the generic one that hands
the averaged gradient to the inner optimizer; on TensorFlow and JAX, the backend's own path.
"""

from __future__ import annotations

import sys
from pathlib import Path

import keras
import numpy as np
import pytest
from keras_helpers import BACKEND

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cycle_table import LR, SCENARIOS, check, initial_params, replay  # noqa: E402

from gradient_accumulator.keras import GradientAccumulateOptimizer  # noqa: E402

PATHS = ["core", "generic"] if BACKEND == "torch" else ["backend"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("s", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_cycle_table_through_the_keras_wrapper(s, path):
    clip = {} if s.max_grad_norm is None else {"global_clipnorm": s.max_grad_norm}
    live = {}

    def build(kernel, bias) -> None:
        live["params"] = [keras.Variable(kernel, name="kernel"), keras.Variable(bias, name="bias")]
        live["opt"] = GradientAccumulateOptimizer(
            keras.optimizers.SGD(LR),
            accum_steps=s.accum_steps,
            reduction=s.reduction.upper(),
            use_agc=s.use_agc,
            clip_factor=s.clip_factor,
            eps=s.eps,
            agc_exclude=None,  # the table clips every parameter (both adapters exclude "final")
            use_core={"core": True, "generic": False}.get(path),
            mixed_precision=s.loss_scale is not None,
            initial_scale=s.loss_scale or 32768.0,
            **clip,
        )
        live["opt"].build(live["params"])

    def micro_step(grads, weight):
        opt = live["opt"]
        scale = np.float32(keras.ops.convert_to_numpy(opt.loss_scale))
        grads = [None if g is None else keras.ops.convert_to_tensor(g * scale) for g in grads]
        opt.counter("batch_weight").assign(weight)
        opt.apply(grads, live["params"])

    def resume():
        # What loading a checkpoint does: new variables, the optimizer's variables assigned.
        state = [keras.ops.convert_to_numpy(v) for v in live["opt"].variables]
        build(*(keras.ops.convert_to_numpy(p) for p in live["params"]))
        for var, value in zip(live["opt"].variables, state):
            var.assign(value)

    build(*initial_params())
    assert replay(s, micro_step, lambda: live["opt"].flush(), resume) == s.nonfinite_cycles
    check(s, *(keras.ops.convert_to_numpy(p) for p in live["params"]))
