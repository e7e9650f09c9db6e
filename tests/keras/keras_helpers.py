"""Small models, data and reference runs shared by the Keras tests (tiny so three backends fit
in a few minutes)."""

from __future__ import annotations

import keras
import numpy as np

from gradient_accumulator.keras import (
    GradientAccumulateModel,
    GradientAccumulateOptimizer,
    adaptive_clip_grad,
)

BACKEND = keras.backend.backend()
FEATURES, HIDDEN, OUTPUTS = 6, 8, 3
# Equivalence tolerance of the issue: max|Δw| / max|w| in float32.
TOL = 1e-5
OPTIMIZERS = ("SGD", "SGD-momentum", "Adam", "AdamW", "RMSprop")
_STRATEGIES: dict = {}


def mirrored(replicas: int):
    """The process's one ``tf.distribute.MirroredStrategy`` over ``replicas`` logical CPUs.

    Shared by every test: TensorFlow's collective instance keys restart with each new strategy,
    so two strategies over the same devices in one process can pair a reduction of one model
    with another's (measured: "Shape mismatch in the collective instance", which then aborts
    every later collective; whether a run hit it depended on which tests ran before).
    """
    import tensorflow as tf

    if replicas not in _STRATEGIES:
        _STRATEGIES[replicas] = tf.distribute.MirroredStrategy(
            [f"/cpu:{i}" for i in range(replicas)]
        )
    strategy = _STRATEGIES[replicas]
    assert strategy.num_replicas_in_sync == replicas
    return strategy


def data(n: int = 64, seed: int = 0, features: int = FEATURES, outputs: int = OUTPUTS):
    """Seeded regression data (x, y) in float32."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    w = rng.normal(size=(features, outputs)).astype("float32")
    y = (np.tanh(x @ w) + 0.1 * rng.normal(size=(n, outputs))).astype("float32")
    return x, y


def mlp(seed: int = 0, features: int = FEATURES, bn: type | None = None, **bn_kwargs):
    """Inputs and outputs of Dense(8, tanh) [→ BN] → Dense(3), seeded."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((features,))
    h = keras.layers.Dense(HIDDEN, activation="tanh")(inputs)
    if bn is not None:
        h = bn(**bn_kwargs)(h)
    outputs = keras.layers.Dense(OUTPUTS)(h)
    return inputs, outputs


def flat(model) -> np.ndarray:
    """All weights of ``model`` as one float64 vector."""
    return np.concatenate([np.asarray(w, np.float64).ravel() for w in model.get_weights()])


def rel_diff(a, b) -> float:
    """max|a − b| / max|b| in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def schedule():
    """A learning-rate schedule that changes at every update (so step counting shows)."""
    return keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=1, decay_rate=0.85)


def make_inner(name: str, lr=None):
    """A fresh Keras optimizer by test name, with the decaying schedule by default."""
    lr = schedule() if lr is None else lr
    if name == "SGD":
        return keras.optimizers.SGD(lr)
    if name == "SGD-momentum":
        return keras.optimizers.SGD(lr, momentum=0.9, nesterov=True)
    if name == "Adam":
        return keras.optimizers.Adam(lr)
    if name == "AdamW":
        return keras.optimizers.AdamW(lr, weight_decay=0.05)
    if name == "RMSprop":
        return keras.optimizers.RMSprop(lr, momentum=0.5)
    raise ValueError(name)


def with_reference_agc(optimizer, excluded: int = 2, clip_factor: float = 0.01, eps: float = 1e-3):
    """The same optimizer, clipping each (big-batch) gradient with AGC before its update.

    The last ``excluded`` variables (the final Dense kernel and bias) are left unclipped.
    """
    base = type(optimizer)

    class ReferenceAGC(base):
        def _clip_gradients(self, grads):
            params = self._trainable_variables
            keep = len(params) - excluded
            return [
                adaptive_clip_grad([p], [g], clip_factor, eps)[0] if i < keep else g
                for i, (p, g) in enumerate(zip(params, grads))
            ]

    return ReferenceAGC.from_config(optimizer.get_config())


def train_big_batch(
    name: str, use_agc: bool, accum: int, micro: int, epochs: int = 2, seed: int = 0
):
    """Weights after training a plain model with batches of ``accum·micro`` (the reference)."""
    x, y = data()
    inputs, outputs = mlp(seed)
    model = keras.Model(inputs, outputs)
    inner = make_inner(name)
    model.compile(with_reference_agc(inner) if use_agc else inner, loss="mse")
    model.fit(x, y, batch_size=accum * micro, epochs=epochs, shuffle=False, verbose=0)
    return flat(model)


def train_accumulated(
    wrapper: str,
    name: str,
    use_agc: bool,
    accum: int,
    micro: int,
    epochs: int = 2,
    seed: int = 0,
    use_core=None,
    run_eagerly: bool = False,
):
    """Weights after training with ``accum`` micro-batches of ``micro`` per update."""
    x, y = data()
    inputs, outputs = mlp(seed)
    if wrapper == "model":
        model = GradientAccumulateModel(
            accum_steps=accum, use_agc=use_agc, inputs=inputs, outputs=outputs
        )
        model.compile(make_inner(name), loss="mse", run_eagerly=run_eagerly)
    else:
        model = keras.Model(inputs, outputs)
        opt = GradientAccumulateOptimizer(
            make_inner(name), accum_steps=accum, use_agc=use_agc, use_core=use_core
        )
        model.compile(opt, loss="mse", run_eagerly=run_eagerly)
    model.fit(x, y, batch_size=micro, epochs=epochs, shuffle=False, verbose=0)
    return flat(model), model
