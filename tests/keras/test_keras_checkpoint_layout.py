"""One saved layout on every backend, before and after the JAX state was packed.

On JAX the wrapper keeps its seven scalars and seen flags in two packed variables and has no
learning-rate variable of its own (``_packed``: each optimizer variable costs Keras's JAX
``fit`` host time per step). Its files keep the unpacked layout. The ``.keras`` files in
``data/`` were written mid-cycle by the version before the packing, one per backend
(``data/make_checkpoints.py``); each must load on every backend with its pending micro-batches
and go on to the update that version computed.
"""

from __future__ import annotations

import os
import sys
import warnings
import zipfile

import h5py
import keras
import numpy as np
import pytest

DATA = os.path.join(os.path.dirname(__file__), "data")
sys.path.insert(0, DATA)
import make_checkpoints  # noqa: E402

BACKENDS = ("jax", "tensorflow", "torch")


def _optimizer_arrays(path: str) -> list[np.ndarray]:
    """The optimizer's saved arrays of a ``.keras`` file, by position."""
    with zipfile.ZipFile(path) as z, z.open("model.weights.h5") as f, h5py.File(f) as h5:
        group = h5["optimizer"]["vars"]
        return [np.asarray(group[str(i)]) for i in range(len(group))]


@pytest.mark.parametrize("written_on", BACKENDS)
def test_a_mid_cycle_file_from_before_the_packing_resumes_exactly(written_on):
    """Loaded mid-cycle (two micro-batches of weight 1 and 2 pending, one update made under
    loss scaling), the wrapper holds the file's counters, each with its own value, and the
    file's cycle and makes the update the old version made after two more: bit for bit from
    a file of the same backend, within 2 float32 ulps of Adam's step from another backend's."""
    if written_on == "torch" and keras.backend.backend() != "torch":
        pytest.skip(
            "a file written on torch names the torch backend's own Adam class, as plain Keras's "
            "does: it loads on torch only"
        )
    expected = np.load(os.path.join(DATA, f"mid_cycle_{written_on}.npz"))
    model = keras.saving.load_model(os.path.join(DATA, f"mid_cycle_{written_on}.keras"))
    opt = model.optimizer
    assert opt.pending() == int(expected["pending"]) == 2
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == int(expected["iterations"]) == 1
    assert int(keras.ops.convert_to_numpy(opt.micro_steps)) == 6
    counters = {
        name: float(keras.ops.convert_to_numpy(opt.counter(name)))
        for name in ("micro_step", "total_weight", "nonfinite", "batch_weight")
        + ("loss_scale", "growth", "skipped")
    }
    assert counters == {
        "micro_step": 2.0,
        "total_weight": 3.0,
        "nonfinite": 0.0,
        "batch_weight": 1.0,
        "loss_scale": 1024.0,
        "growth": 1.0,
        "skipped": 0.0,
    }
    for acc, name in zip(opt.accumulators, ("kernel", "bias")):
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(acc), expected[f"{name}_accumulator"]
        )
    kernel, bias = model.get_weights()
    np.testing.assert_array_equal(kernel, expected["weights_at_save_kernel"])
    np.testing.assert_array_equal(bias, expected["weights_at_save_bias"])

    make_checkpoints.micro_batch(model, 6, 1.0)
    make_checkpoints.micro_batch(model, 7, 0.5)
    assert opt.pending() == 0
    kernel, bias = model.get_weights()
    moved = np.abs(kernel - expected["weights_at_save_kernel"]).max()
    assert moved > 1e-3  # the cycle ended in an update
    if written_on == keras.backend.backend():
        np.testing.assert_array_equal(kernel, expected["weights_after_kernel"])
        np.testing.assert_array_equal(bias, expected["weights_after_bias"])
    else:
        np.testing.assert_allclose(kernel, expected["weights_after_kernel"], rtol=0, atol=2e-7)
        np.testing.assert_allclose(bias, expected["weights_after_bias"], rtol=0, atol=2e-7)


def test_a_file_written_now_has_the_layout_of_the_old_ones(tmp_path):
    """The optimizer's saved arrays, by position, have the shapes of the file the version
    before the packing wrote on this backend, and the values of a reload of that file."""
    backend = keras.backend.backend()
    old_path = os.path.join(DATA, f"mid_cycle_{backend}.keras")
    old = _optimizer_arrays(old_path)
    model = keras.saving.load_model(old_path)
    new_path = str(tmp_path / "again.keras")
    model.save(new_path)
    new = _optimizer_arrays(new_path)
    assert [a.shape for a in new] == [a.shape for a in old]
    assert [a.dtype for a in new] == [a.dtype for a in old]
    for i, (a, b) in enumerate(zip(new, old)):
        np.testing.assert_array_equal(a, b, err_msg=f"optimizer array {i}")


def test_a_file_with_another_number_of_arrays_is_skipped_with_a_warning(tmp_path):
    """As Keras does for any optimizer: a store of another length loads nothing and warns;
    the state stays as it was."""
    model, opt = make_checkpoints.model_and_optimizer()
    make_checkpoints.micro_batch(model, 0, 1.0)
    with pytest.warns(UserWarning, match="Skipping variable loading"):
        opt.load_own_variables({"0": np.array(0)})
    assert opt.pending() == 1
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(opt.accumulators[1]), make_checkpoints.grads(0)[1]
    )


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="the packing is JAX's")
def test_jax_state_is_four_arrays_for_a_dense_layer():
    """On JAX the wrapper's own state is its iteration counter, the packed counters, the packed
    floats (with the seen flags) and one flat float32 vector holding the small accumulators: 4
    arrays for a Dense layer, where the unpacked layout had 11. Each accumulator there is a
    slice of the flat one, with its variable's shape, read and written like a variable."""
    model, opt = make_checkpoints.model_and_optimizer()
    opt.build(model.trainable_variables)
    own = opt.variables[: len(opt.variables) - len(opt.optimizer.variables)]
    sizes = [int(np.prod(v.shape)) for v in model.trainable_variables]
    # The counters: three saved, and the epoch clock's two, which are not.
    assert [tuple(v.shape) for v in own] == [(), (5,), (6,), (sum(sizes),)]
    assert opt.counter("loss_scale").packed is own[2]
    assert float(opt.counter("batch_weight")) == 1.0
    accs = opt.accumulators
    assert [a.packed for a in accs] == [own[3], own[3]]
    assert [a.shape for a in accs] == [tuple(v.shape) for v in model.trainable_variables]
    assert [keras.backend.standardize_dtype(a.dtype) for a in accs] == ["float32"] * 2
    values = [
        np.arange(n, dtype="float32").reshape(a.shape) + 10 * i
        for i, (n, a) in enumerate(zip(sizes, accs))
    ]
    for a, v in zip(accs, values):
        a.assign(v)
    for a, v in zip(accs, values):
        np.testing.assert_array_equal(a.numpy(), v)
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(a.value), v)
    flat = np.asarray(own[3].value)
    np.testing.assert_array_equal(flat, np.concatenate([v.reshape(-1) for v in values]))


def test_a_loss_scale_optimizer_around_the_wrapper_saves_and_loads_mid_cycle(tmp_path):
    """``LossScaleOptimizer(wrapper)`` saves its variables and the wrapper's in the one layout
    too: a round trip mid-cycle loads without Keras's skip warning and keeps the cycle and the
    loss scale."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    from gradient_accumulator import GradientAccumulateOptimizer

    inner = GradientAccumulateOptimizer(keras.optimizers.Adam(0.01), accum_steps=4, use_core=False)
    model.compile(
        optimizer=keras.optimizers.LossScaleOptimizer(inner, initial_scale=64.0), loss="mse"
    )
    for i in range(3):
        make_checkpoints.micro_batch(model, i, 1.0)
    path = str(tmp_path / "lso.keras")
    model.save(path)
    # The scaler's own variables, then the wrapper's 18 arrays of the unpacked layout (those of
    # the files in data/: iteration, learning rate, 7 scalars, 2 accumulators, the seen flags,
    # Adam's 6).
    n_old = len(_optimizer_arrays(os.path.join(DATA, f"mid_cycle_{keras.backend.backend()}.keras")))
    assert n_old == 18
    assert len(_optimizer_arrays(path)) == len(model.optimizer._variables) + n_old
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Skipping variable loading")
        loaded = keras.saving.load_model(path)
    acc = loaded.optimizer.inner_optimizer
    assert acc.pending() == 3
    assert float(keras.ops.convert_to_numpy(acc.loss_scale)) == 64.0
    expected = sum(make_checkpoints.grads(i)[1] for i in range(3))  # as given: still scaled
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(acc.accumulators[1]), expected)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="the packing is JAX's")
def test_jax_counters_work_in_ops_and_traced_functions():
    """A packed counter is used as a variable is: in ``keras.ops`` calls, inside a jitted
    function (read through its current value, not copied to the host), and ``loss_scale`` is
    a value with arithmetic. ``assign`` after ``fit`` (whose step purges and restores the
    variables' values) writes the element."""
    import jax

    model, opt = make_checkpoints.model_and_optimizer()
    opt.build(model.trainable_variables)
    scale = opt.counter("loss_scale")
    assert float(keras.ops.multiply(2.0, scale)) == 2048.0
    assert float(jax.jit(lambda x: keras.ops.multiply(x, scale))(3.0)) == 3072.0
    assert float(opt.loss_scale * 2) == 2048.0
    x = np.ones((8, 3), "float32")
    model.fit(x, np.zeros((8, 2), "float32"), batch_size=4, epochs=1, verbose=0)
    opt.counter("batch_weight").assign(5.0)
    assert float(opt.counter("batch_weight")) == 5.0
    assert float(opt.counter("loss_scale")) == 1024.0  # the other elements kept
