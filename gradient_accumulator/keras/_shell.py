"""The interface every shell of the Keras cycle has, and the pieces they share.

A shell is the per-backend half of a :class:`GradientAccumulateOptimizer`, chosen once by
``build()`` (``_shells.make``): it creates the wrapper's own variables (on the wrapper, whose
state they are and with which they are saved), folds a micro-step into them and ends a cycle, in
the backend's way. The wrapper holds it and delegates; a shell reads the wrapper's variables and
settings, the wrapper only calls the methods below.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from keras import ops

from gradient_accumulator.keras import _boundary_grads, _cycle


def accumulator_name(variable: Any) -> str:
    """The name of ``variable``'s accumulator: its path, then ``_accumulator``."""
    return getattr(variable, "path", variable.name).replace("/", "_") + "_accumulator"


class Shell:
    """The per-backend behaviour of one wrapper (``opt``), chosen once at its ``build``."""

    # fit's step hands this shell the batch size as a tensor of the step (callbacks.weighing)
    # instead of writing it into counter("batch_weight").
    takes_step_weight = False

    def __init__(self, opt: Any) -> None:
        self._opt = opt

    # ------------------------------------------------------------------ the interface

    def build(self, var_list: list[Any]) -> None:
        """Create the wrapper's counters, loss scale, seen flags and accumulators."""
        raise NotImplementedError

    def micro_step(self, grads: list[Any], variables: list[Any], weight: Any) -> None:
        """Fold one micro-step (``grads`` follow the wrapper's variables, None for a missing
        one; ``weight`` the checked micro-batch weight or None); end the cycle at its last."""
        raise NotImplementedError

    def flush(self, present: list[bool], overwrites: bool) -> None:
        """End the pending cycle now (``present``: the seen flags; ``overwrites``: the wrapper
        has ``overwrite_with_gradient`` variables), those variables included."""
        raise NotImplementedError

    def stateless_apply(
        self, optimizer_variables: Sequence[Any], grads: Sequence[Any], trainable_variables: Any
    ) -> tuple[list[Any], list[Any]]:
        """Keras's functional ``apply`` (JAX's shell only)."""
        raise NotImplementedError("stateless_apply is the JAX backend's")

    def counters(self) -> dict[str, int]:
        """``micro_step``, ``skipped`` and ``steps_left`` now, read from the variables."""
        raise NotImplementedError

    def set_epoch_clock(self, epoch_steps: int, steps_left: int) -> bool:
        """Set fit's epoch clock; False, and nothing done, where the shell has none."""
        return False

    def zero_between_cycles(self, idle: bool = False) -> None:
        """Bring the accumulators to what a new cycle expects, if no cycle is pending (after a
        load or ``reset_cycle``; ``idle``: the counters are zeroed already)."""
        return None

    # ------------------------------------------------------------ shared by the shells

    def _accumulator(self, variable: Any) -> Any:
        """A float32 accumulator of ``variable``'s shape, laid out like it under a Keras
        distribution (a sharded kernel gets a sharded accumulator: the paths of a LayoutMap do
        not match ours)."""
        return self._opt.add_variable(
            shape=variable.shape,
            dtype="float32",
            layout=getattr(variable, "_layout", None),
            name=accumulator_name(variable),
        )

    def final_grads(
        self, accs: list[Any], variables: list[Any], params: list[Any], scale: Any | None
    ) -> list[Any]:
        """:func:`_boundary_grads.final_grads` with the wrapper's AGC mask and clipping."""
        agc = None
        if self._opt.use_agc:
            agc = [self._opt._agc_mask[self._opt._get_variable_index(v)] for v in variables]
        return _boundary_grads.final_grads(
            accs,
            variables,
            params,
            scale,
            agc=agc,
            clip_factor=self._opt.clip_factor,
            eps=self._opt.eps,
            clip=self._opt._clip_gradients,
        )

    def _eager(self) -> bool:
        """True when this call runs in Python on concrete values (not traced or compiled)."""
        return not _cycle.traced(self._opt._skipped.value)

    def _flush_key(self, present: tuple[bool, ...]) -> tuple:
        """What a compiled flush depends on: the seen flags and every setting it reads."""
        return (
            present,
            self._opt.accum_steps,
            self._opt._options.reduction,
            self._opt.mixed_precision,
            self._opt.on_nonfinite,
            self._opt.use_agc,
            self._opt.clip_factor,
            self._opt.eps,
            self._opt.clipnorm,
            self._opt.clipvalue,
            self._opt.global_clipnorm,
            self._opt.dynamic_growth_steps,
            self._opt._static_scale,
        )

    def grad_scale(self, total_weight: Any, loss_scale: Any) -> Any:
        return _cycle.grad_scale(
            total_weight, loss_scale, self._opt._options, self._opt._static_scale
        )

    def overwrite_maxima(
        self,
        grads: Sequence[Any],
        micro_step: Any,
        seen: Any,
        acc_value: Callable[[int], Any] | None = None,
    ) -> list[tuple]:
        """``(index, accumulator, cycle maximum)`` of the ``overwrite_with_gradient`` variables.

        As in Keras's own accumulation, such a variable (a float8 scale or amax history) keeps
        its value during a cycle and is overwritten at the boundary with the elementwise maximum
        of the cycle's gradients; the accumulator holds the running maximum, not a sum. The
        maximum is over the micro-steps that have a gradient (``seen``: the flags before this
        one); one without any in the cycle is left alone. ``grads`` follow the wrapper's
        variables; ``acc_value(i)``: variable ``i``'s accumulator value on the functional path,
        asked only for the chosen variables (a slice of the flat one costs an op).
        """
        out: list[tuple] = []
        chosen = [
            i
            for i, v in enumerate(self._opt._trainable_variables)
            if getattr(v, "overwrite_with_gradient", False)
        ]
        if not chosen:  # the usual case: no op at all
            return out
        first = ops.equal(micro_step, 0)
        for i in chosen:
            g = grads[i]
            acc = self._opt._accumulators[i] if acc_value is None else acc_value(i)
            previous = acc.value if acc_value is None else acc
            if g is None:
                maximum = previous
            else:
                g = ops.cast(g, "float32")
                fresh = ops.logical_or(first, ops.less_equal(seen[i], 0.0))
                maximum = ops.where(fresh, g, ops.maximum(previous, g))
            out.append((i, acc, maximum))
        return out

    def flush_overwrites(self, seen: Sequence[bool]) -> None:
        """After a flush: the ``overwrite_with_gradient`` variables seen in the cycle take its
        maximum (their accumulators hold it), as at a boundary."""
        for i, v in enumerate(self._opt._trainable_variables):
            if seen[i] and getattr(v, "overwrite_with_gradient", False):
                v.assign(ops.cast(self._opt._accumulators[i].value, v.dtype))
