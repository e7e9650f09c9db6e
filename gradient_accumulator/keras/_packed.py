"""The wrapper's state packed into few variables on JAX, saved in the unpacked layout.

Keras's JAX ``fit`` passes every optimizer variable into and out of its compiled step and
tracks each one again after every step, so each extra array costs host time per step: with
Keras's built-in accumulation on the digits-sized model of ``benchmarks/keras_step.py``, ten
extra scalar variables cost 10% per epoch in wall time and 18% in CPU time, one vector of ten
about nothing. On JAX the wrapper therefore keeps its three integer counters in one vector
(:data:`INTS`, with the two of ``fit``'s epoch clock, :data:`EPOCH`, which are not saved)
and its four float scalars and the per-variable seen flags in another
(:data:`FLOATS`, then the flags), and has no learning-rate variable of its own (the inner
optimizer's is the one used). Each scalar stays reachable as a :class:`Slot`, used like the
variable it replaces. Without a Keras distribution the accumulators of small variables
(biases, norms' scales, small kernels: :data:`FLAT_MAX_ELEMENTS`) share one flat float32
variable too, each a :class:`Slot` with its variable's shape, and a micro-step folds their
gradients into it in one fused pass; a large variable's accumulator keeps a variable of its own,
where a concatenation fused into its fold would cost more than the array it saves. Under a
distribution each accumulator keeps its variable's layout, one variable each.

Keras's files (``.keras``, ``.weights.h5``) keep one layout on every backend:
:func:`saved_entries` lists the state in the order the unpacked variables had (iteration,
learning rate, the seven scalars, the accumulators, the seen flags, the inner optimizer's), so
files written before the packing, or on another backend, load, and files written now load there
too. Checkpoints that save variables by path instead (``Model.get_state_tree``, Orbax) see the
packed variables' own paths on JAX and do not carry the counters and accumulators across
backends or from before the packing.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

# The epoch's clock (see callbacks.FlushAccumulation): the steps of each epoch of the running
# ``fit`` and the steps left in it (0: no clock). Transient: never saved.
EPOCH = ("epoch_steps", "steps_left")
INTS = ("micro_step", "growth", "skipped", *EPOCH)
FLOATS = ("total_weight", "nonfinite", "batch_weight", "loss_scale")
# The unpacked order of the scalars (the order of older checkpoints).
SCALARS = (
    "micro_step",
    "total_weight",
    "nonfinite",
    "batch_weight",
    "loss_scale",
    "growth",
    "skipped",
)


# Accumulators of at most this many elements share one flat variable. Keras's JAX step costs
# host time per state array (about 3 us on a 2-core CPU); folding into a flat variable costs a
# concatenation fused into the fold, about 0.3 ns more per element on XLA's CPU backend than a
# fold per variable (6x the fold at 662k parameters in 8 tensors), so only small tensors
# (biases, norms' scales, small kernels) gain from sharing one.
FLAT_MAX_ELEMENTS = 4096


def flat_members(var_list: list[Any]) -> list[int]:
    """The variables whose accumulators share one flat variable, by position: those of at most
    :data:`FLAT_MAX_ELEMENTS` elements, if two or more; none under a Keras distribution, where
    each accumulator is laid out (sharded) like its variable."""
    if keras.distribution.distribution() is not None:
        return []
    if any(getattr(v, "_layout", None) is not None for v in var_list):
        return []
    small = [i for i, v in enumerate(var_list) if math.prod(v.shape) <= FLAT_MAX_ELEMENTS]
    return small if len(small) >= 2 else []


def unused_learning_rate() -> float:
    """The wrapper's own learning rate: never read (the inner optimizer's is used)."""
    return 0.0


class Slot:
    """One element of a packed variable (or a slice of it), used like a variable of its own:
    ``value`` (also inside Keras's stateless scopes), ``assign``, ``numpy``.

    Attributes:
        packed: the ``keras.Variable`` holding it.
        index: its element (an ``int``) or elements (a ``slice``) there.
        name: its name (an accumulator's: its variable's path, then ``_accumulator``).
    """

    def __init__(
        self, packed: Any, index: int | slice, name: str, shape: tuple | None = None
    ) -> None:
        self.packed = packed
        self.index = index
        self.name = name
        # An accumulator's shape (its variable's): the flat slice is reshaped to it.
        self._reshaped = shape

    @property
    def shape(self) -> tuple:
        if self._reshaped is not None:
            return self._reshaped
        if isinstance(self.index, int):
            return ()
        return (len(range(*self.index.indices(self.packed.shape[0]))),)

    @property
    def dtype(self) -> str:
        return self.packed.dtype

    @property
    def path(self) -> str:
        return f"{self.packed.path}/{self.name}"

    @property
    def value(self) -> Any:
        return self.take(self.packed.value)

    def take(self, whole: Any) -> Any:
        """This slot's elements of ``whole`` (the packed variable's value, concrete or traced),
        in this slot's shape."""
        out = whole[self.index]
        return out if self._reshaped is None else out.reshape(self._reshaped)

    def put(self, whole: Any, value: Any) -> Any:
        """``whole`` (the packed variable's value, concrete or traced) with this slot's
        elements replaced by ``value``, of this slot's shape."""
        import jax.numpy as jnp

        new = jnp.asarray(value, dtype=whole.dtype)
        if tuple(new.shape) != self.shape:  # as keras.Variable.assign: no broadcasting
            raise ValueError(
                f"value of shape {tuple(new.shape)} cannot be assigned to {self.name} of shape "
                f"{self.shape}"
            )
        flat = new.reshape(-1) if isinstance(self.index, slice) else new
        return whole.at[self.index].set(flat)

    def assign(self, value: Any) -> None:
        self.packed.assign(self.put(self.packed.value, value))

    def numpy(self) -> np.ndarray:
        if self._reshaped is not None:
            # An accumulator: sliced on the device, so only its own elements reach the host.
            return np.asarray(self.value)
        # The whole variable to the host, then the element: no eager op on the device (an
        # eager JAX slice costs tens of microseconds, and callbacks read counters every epoch).
        # (Through the JAX array: keras.Variable.numpy() goes through an ``__array__`` that
        # NumPy 2 warns about.)
        return np.asarray(np.asarray(self.packed.value)[self.index])

    def __jax_array__(self) -> Any:
        # As keras.Variable on JAX: usable in jax.numpy and keras.ops calls, traced ones too.
        return self.value

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.numpy()
        return out if dtype is None else out.astype(dtype)

    def __int__(self) -> int:
        return int(self.numpy())

    def __float__(self) -> float:
        return float(self.numpy())

    def __repr__(self) -> str:
        return f"<Slot {self.name} of {self.packed.path}: {self.numpy()!r}>"


def locate(variables: Sequence[Any], target: Any) -> tuple[int, int | slice | None]:
    """``(position of the variable holding target in variables, its index there or None)``,
    for a variable or a counter's :class:`Slot` (:func:`read` and :func:`write` do not
    reshape an accumulator's)."""
    holder = getattr(target, "packed", target)
    position = [id(v) for v in variables].index(id(holder))
    return position, getattr(target, "index", None)


def read(values: Sequence[Any], where: tuple[int, int | slice | None]) -> Any:
    """The value at ``where`` (from :func:`locate`) in a list of variable values."""
    position, index = where
    return values[position] if index is None else values[position][index]


def write(values: list[Any], where: tuple[int, int | slice | None], value: Any) -> None:
    """Put ``value`` at ``where`` (from :func:`locate`) in a list of variable values."""
    position, index = where
    if index is None:
        values[position] = value
    else:
        whole = values[position]
        values[position] = whole.at[index].set(value.astype(whole.dtype))


def set_ints(ints: Any, start: int, values: np.ndarray) -> Any:
    """``ints`` (the packed counters' value) with ``values`` from position ``start`` on, in
    one compiled call: a Keras ``assign`` of a host array there costs a transfer that waits
    for the work still queued (about 0.25 ms at the end of a ``fit`` epoch, against 0.05)."""
    global _SET_INTS
    if _SET_INTS is None:
        import jax

        _SET_INTS = jax.jit(lambda whole, at, new: jax.lax.dynamic_update_slice(whole, new, (at,)))
    return _SET_INTS(ints, np.int32(start), values.astype(ints.dtype))


_SET_INTS = None


def unpack(ints: Any, floats: Any) -> dict[str, Any]:
    """The scalars and seen flags, by name, from the two packed values."""
    out = {name: ints[i] for i, name in enumerate(INTS)}
    out.update({name: floats[i] for i, name in enumerate(FLOATS)})
    out["seen"] = floats[len(FLOATS) :]
    return out


def pack(own: dict[str, Any], int_dtype: Any) -> tuple[Any, Any]:
    """The two packed values from the scalars and seen flags of ``own``."""
    import jax.numpy as jnp

    ints = jnp.stack([jnp.asarray(own[name], dtype=int_dtype) for name in INTS])
    floats = jnp.concatenate(
        [
            jnp.stack([jnp.asarray(own[name], dtype=jnp.float32) for name in FLOATS]),
            jnp.asarray(own["seen"], dtype=jnp.float32),
        ]
    )
    return ints, floats


def initial_floats(initial_scale: float) -> Any:
    """The packed floats' initializer: weight 0, no non-finite value, batch weight 1, the
    initial loss scale, no variable seen."""

    def init(shape: Any, dtype: Any = None) -> Any:
        import jax.numpy as jnp

        out = np.zeros(shape, dtype="float32")
        out[FLOATS.index("batch_weight")] = 1.0
        out[FLOATS.index("loss_scale")] = initial_scale
        return jnp.asarray(out)  # a device array, as Keras's own initializers give

    return init


def saved_entries(opt: Any) -> list[Any]:
    """The wrapper's state in the unpacked layout: variables and :class:`Slot` s, ``None``
    for the learning rate it does not keep on JAX, then the inner optimizer's variables."""
    own = [opt._iterations, None]
    if opt.built:
        own += [getattr(opt, f"_{name}") for name in SCALARS]
        own += list(opt._accumulators) + [opt._seen]
    return own + list(opt.optimizer.variables)


def save(entries: Sequence[Any], store: Any) -> None:
    """Write ``entries`` (from :func:`saved_entries`) by position, as Keras saves."""
    for i, entry in enumerate(entries):
        store[str(i)] = np.zeros((), "float32") if entry is None else entry.numpy()


def load(entries: Sequence[Any], store: Any, name: str) -> None:
    """Assign ``entries`` from a store written in their layout; as Keras does, skip with a
    warning when the number of saved arrays differs."""
    if len(store.keys()) != len(entries):
        warnings.warn(
            f"Skipping variable loading for optimizer '{name}', because it has "
            f"{len(entries)} variables whereas the saved optimizer has "
            f"{len(store.keys())} variables.",
            stacklevel=3,
        )
        return
    for i, entry in enumerate(entries):
        if entry is not None:
            entry.assign(store[str(i)])
