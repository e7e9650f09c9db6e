"""End-of-epoch handling of a cycle cut short by the end of the data."""

from __future__ import annotations

from typing import Any

import keras

from gradient_accumulator.keras.optimizer import GradientAccumulateOptimizer

__all__ = ["FlushAccumulation", "flush_batchnorm"]


def find_accumulator(optimizer: Any) -> GradientAccumulateOptimizer | None:
    """The GradientAccumulateOptimizer in ``optimizer`` (possibly inside a LossScaleOptimizer)."""
    while optimizer is not None:
        if isinstance(optimizer, GradientAccumulateOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return None


class FlushAccumulation(keras.callbacks.Callback):
    """Applies the leftover micro-batches of each epoch (``leftover="apply"``) before validation.

    :class:`GradientAccumulateModel` adds it to ``fit`` itself; add it by hand when a plain
    ``keras.Model`` is compiled with a :class:`GradientAccumulateOptimizer`. With
    ``leftover="carry"`` it does nothing and the cycle goes on into the next epoch.

    After every batch it also reports a cycle the compiled step dropped as non-finite
    (``on_nonfinite``): a ``NonFiniteGradientWarning``, or ``NonFiniteGradientError`` out of
    ``fit``.

    Example:
        >>> import numpy as np, keras
        >>> from gradient_accumulator.keras import FlushAccumulation, GradientAccumulateOptimizer
        >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        >>> model.compile(GradientAccumulateOptimizer("SGD", accum_steps=4), loss="mse")
        >>> x, y = np.ones((6, 2), "float32"), np.ones((6, 1), "float32")
        >>> _ = model.fit(x, y, batch_size=1, verbose=0, callbacks=[FlushAccumulation()])
        >>> int(model.optimizer.iterations)  # one full cycle, then 2 leftover micro-batches
        2
    """

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        """Report a dropped non-finite cycle; flush after the epoch's last batch, when the
        number of batches is known."""
        self._report_nonfinite()
        steps = self.params.get("steps") if self.params else None
        if steps and batch + 1 >= steps:
            self._flush()

    def _report_nonfinite(self) -> None:
        opt = find_accumulator(getattr(self.model, "optimizer", None))
        if opt is None or not opt.built or not opt.drops_nonfinite:
            return
        state = getattr(self.model, "_jax_state", None)
        if state and state.get("optimizer_variables") is not None:
            # JAX fit keeps the current values in the trainer's state until it syncs them.
            index = [id(v) for v in self.model.optimizer.variables].index(
                id(opt.counter("skipped"))
            )
            opt.report_nonfinite(int(state["optimizer_variables"][index]))
        else:
            opt.report_nonfinite()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        """Flush at the end of an epoch of unknown length (no-op when nothing is pending)."""
        self._flush()

    def _flush(self) -> None:
        opt = find_accumulator(getattr(self.model, "optimizer", None))
        if opt is None or opt.leftover != "apply" or not opt.built:
            return
        if keras.backend.backend() == "jax" and hasattr(self.model, "jax_state_sync"):
            self.model.jax_state_sync()
        opt.flush()
        flush_batchnorm(self.model)


def flush_batchnorm(model: Any) -> int:
    """Flush every :class:`AccumBatchNormalization` layer of ``model`` (see its ``flush``).

    Returns:
        The number of layers that had a short cycle pending.
    """
    from gradient_accumulator.keras.layers import AccumBatchNormalization

    layers = model._flatten_layers(include_self=False) if model is not None else []
    return sum(
        bool(layer.flush()) for layer in layers if isinstance(layer, AccumBatchNormalization)
    )
