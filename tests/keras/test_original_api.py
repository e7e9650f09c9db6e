"""The 0.5 package's import paths, names and defaults, and its deprecated arguments/attributes."""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
from keras import ops

import gradient_accumulator
import gradient_accumulator.keras as ga_keras

# What 0.5's modules exported, by module (its __init__ exported all but replace_batchnorm_layers).
ORIGINAL_MODULES = {
    "gradient_accumulator": [
        "GradientAccumulateModel",
        "GradientAccumulateOptimizer",
        "AccumBatchNormalization",
        "adaptive_clip_grad",
        "compute_norm",
        "unitwise_norm",
    ],
    "gradient_accumulator.accumulators": ["GradientAccumulateModel", "GradientAccumulateOptimizer"],
    "gradient_accumulator.layers": ["AccumBatchNormalization"],
    "gradient_accumulator.agc": ["adaptive_clip_grad", "compute_norm", "unitwise_norm"],
    "gradient_accumulator.utils": ["replace_batchnorm_layers"],
}

# 0.5's signatures: (name, default) of the arguments it had, in its order.
ORIGINAL_DEFAULTS = {
    "GradientAccumulateModel": [
        ("accum_steps", 1),
        ("mixed_precision", False),
        ("use_agc", False),
        ("clip_factor", 0.01),
        ("eps", 1e-3),
        ("experimental_distributed_support", False),
    ],
    "GradientAccumulateOptimizer": [
        ("optimizer", "SGD"),
        ("accum_steps", 1),
        ("reduction", "MEAN"),
        ("name", "GradientAccumulateOptimizer"),
    ],
    "AccumBatchNormalization": [
        ("accum_steps", 1),
        ("momentum", 0.99),
        ("epsilon", 1e-3),
        ("trainable", True),
    ],
    "adaptive_clip_grad": [
        ("parameters", None),
        ("gradients", None),
        ("clip_factor", 0.01),
        ("eps", 1e-3),
    ],
    "compute_norm": [("x", None), ("axis", None), ("keepdims", None)],
    "unitwise_norm": [("x", None)],
    "replace_batchnorm_layers": [("model", None), ("accum_steps", None), ("position", "replace")],
}


def test_import_needs_no_framework():
    """``import gradient_accumulator`` loads no ML framework; the 0.5 names resolve lazily."""
    code = (
        "import sys, gradient_accumulator as ga\n"
        "loaded = [m for m in ('keras', 'tensorflow', 'jax', 'torch') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
        "assert {'compute_norm', 'layers', 'agc', 'utils', 'accumulators'} <= set(dir(ga))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("module_name", list(ORIGINAL_MODULES))
def test_original_names_are_the_keras_implementations(module_name):
    """Every 0.5 name at every 0.5 path is the Keras 3 object itself (no second copy)."""
    module = importlib.import_module(module_name)
    for name in ORIGINAL_MODULES[module_name]:
        assert getattr(module, name) is getattr(ga_keras, name), (module_name, name)
    exec(f"from {module_name} import {', '.join(ORIGINAL_MODULES[module_name])}", {})


def test_original_modules_as_attributes_of_the_package():
    """``gradient_accumulator.layers.X`` works after a bare ``import gradient_accumulator``."""
    assert gradient_accumulator.layers.AccumBatchNormalization is ga_keras.AccumBatchNormalization
    assert gradient_accumulator.agc.compute_norm is ga_keras.compute_norm
    assert gradient_accumulator.utils.replace_batchnorm_layers is ga_keras.replace_batchnorm_layers
    assert (
        gradient_accumulator.accumulators.GradientAccumulateOptimizer
        is ga_keras.GradientAccumulateOptimizer
    )
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        gradient_accumulator.nope  # noqa: B018


@pytest.mark.parametrize("name", list(ORIGINAL_DEFAULTS))
def test_original_arguments_keep_their_order_and_defaults(name):
    """0.5's positional order and defaults hold (new arguments come after, keyword-only)."""
    params = list(inspect.signature(getattr(ga_keras, name)).parameters.values())
    for (arg, default), param in zip(ORIGINAL_DEFAULTS[name], params):
        assert param.name == arg
        if default is not None:
            assert param.default == default, (name, arg)


def test_compute_norm_matches_numpy():
    """0.5's ``compute_norm(x, axis, keepdims)``: sqrt(sum(x²)) over the axes."""
    x = np.arange(24, dtype="float32").reshape(2, 3, 4) - 11.5
    got = ops.convert_to_numpy(gradient_accumulator.compute_norm(x, axis=(0, 1), keepdims=True))
    np.testing.assert_allclose(
        got, np.sqrt((x.astype(np.float64) ** 2).sum((0, 1), keepdims=True)), rtol=1e-6
    )
    whole = float(ops.convert_to_numpy(gradient_accumulator.compute_norm(x, None, False)))
    assert whole == pytest.approx(float(np.linalg.norm(x.astype(np.float64))), rel=1e-6)


def _fit(model, opt, x, y):
    model.compile(opt, loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    return np.concatenate([np.ravel(w) for w in model.get_weights()])


def _dense(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((3,))
    return inputs, keras.layers.Dense(2)(inputs)


@pytest.mark.parametrize("key", ["lr", "decay"])
def test_ignored_optimizer_arguments_warn_and_change_nothing(key):
    """0.5's wrapper accepted ``lr``/``decay`` and ignored them: now a DeprecationWarning."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 3)).astype("float32"), rng.normal(size=(16, 2)).astype("float32")
    with pytest.warns(DeprecationWarning, match=f"{key}=.*inner optimizer"):
        opt = ga_keras.GradientAccumulateOptimizer(
            keras.optimizers.SGD(0.1), accum_steps=2, **{key: 0.5}
        )
    assert key not in opt.get_config()
    got = _fit(keras.Model(*_dense()), opt, x, y)
    ref = _fit(
        keras.Model(*_dense()),
        ga_keras.GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), accum_steps=2),
        x,
        y,
    )
    np.testing.assert_array_equal(got, ref)


def test_experimental_distributed_support_warns():
    """The model wrapper's 0.5 switch has no meaning now (distribution needs none)."""
    inputs, outputs = _dense()
    with pytest.warns(DeprecationWarning, match="experimental_distributed_support"):
        ga_keras.GradientAccumulateModel(
            2, False, False, 0.01, 1e-3, True, inputs=inputs, outputs=outputs
        )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r".*gradient-accumulator 0\.5")
        ga_keras.GradientAccumulateModel(accum_steps=2, inputs=inputs, outputs=outputs)


def test_deprecated_attributes_are_aliases(tmp_path):
    """``optimizer.gradients``, ``layer.accum_step_counter``, ``layer.reset_accum()`` warn and
    act on the current state; saving reads no deprecated attribute."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    bn = ga_keras.AccumBatchNormalization(accum_steps=3, name="bn")
    model = ga_keras.GradientAccumulateModel(
        accum_steps=3, inputs=inputs, outputs=keras.layers.Dense(1)(bn(inputs))
    )
    model.compile(keras.optimizers.SGD(0.1), loss="mse")
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(4, 3)).astype("float32"), rng.normal(size=(4, 1)).astype("float32")
    model.train_on_batch(x, y)  # one micro-batch of a 3-step cycle is pending
    opt = model.optimizer
    with pytest.warns(DeprecationWarning, match="use accumulators"):
        grads = opt.gradients
    assert [id(g) for g in grads] == [id(a) for a in opt.accumulators]
    assert any(np.any(ops.convert_to_numpy(a) != 0) for a in grads)
    with pytest.warns(DeprecationWarning, match="accum_step"):
        counter = bn.accum_step_counter
    assert counter is bn.accum_step and int(ops.convert_to_numpy(counter)) == 1
    with pytest.warns(DeprecationWarning, match="reset_accum"):
        bn.reset_accum()
    assert int(ops.convert_to_numpy(bn.accum_step)) == 0
    np.testing.assert_array_equal(ops.convert_to_numpy(bn.accum_mean), 0.0)
    with pytest.raises(AttributeError, match="no_such_thing"):
        bn.no_such_thing  # noqa: B018
    with pytest.raises(AttributeError, match="no_such_thing"):
        opt.no_such_thing  # noqa: B018
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r".*gradient-accumulator 0\.5")
        model.save(tmp_path / "m.keras")
