"""Keras internals the package relies on, and small helpers shared by the Keras modules.

:data:`REACHES` lists every private attribute of Keras the package touches (and the JAX
internals the JAX step reads its update's structure from, and the TensorFlow internals of the
distributed step), the global patch it installs (:func:`install_fit_hook`), the instance
patches of Keras objects and the two reads of a caller's frame (:func:`model_being_cloned`,
:func:`loss_scale_optimizer_wrapping`),
with the versions they were checked against; ``tests/keras/test_keras_private_reaches.py``
probes each against the installed libraries and names the one an upgrade moved. Also:
deprecation warnings for 0.5's arguments and attributes, op ordering in TensorFlow graphs, and
host copies of variables.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
from collections.abc import Sequence
from types import FrameType
from typing import Any, Callable

import keras
import numpy as np

from gradient_accumulator._reaches import Reach
from gradient_accumulator.deprecation import GradientAccumulatorDeprecationWarning
from gradient_accumulator.keras._packed import Slot

KERAS = "3.15.1"

REACHES = (
    Reach(
        "keras",
        "keras.src.utils.tracking.no_automatic_dependency_tracking",
        KERAS,
        "keeping the optimizer wrapper's own containers out of Keras's variable tracking "
        "(keras/optimizer.py)",
    ),
    Reach(
        "keras",
        "keras.optimizers.Optimizer(): _iterations, _variables, _trainable_variables, "
        "_track_variable, _get_variable_index, _check_variables_are_known, _clip_gradients, "
        "_use_weight_decay",
        KERAS,
        "the optimizer wrapper, a keras.optimizers.Optimizer that builds, tracks and clips "
        "like one (keras/optimizer.py) and reads the inner optimizer's weight-decay rule "
        "(keras/_core_path.py)",
    ),
    Reach(
        "keras",
        "keras.layers.Layer()._build_shapes_dict",
        KERAS,
        "AccumBatchNormalization's build config (keras/layers.py)",
    ),
    Reach(
        "keras",
        "keras.Model()._flatten_layers(include_self=False)",
        KERAS,
        "finding the AccumBatchNormalization layers to flush at an epoch's end "
        "(keras/callbacks.py)",
    ),
    Reach(
        "keras",
        "keras.Model()._jax_state (JAX backend, during fit)",
        KERAS,
        "reading the skipped-cycle counter during a JAX fit without syncing the whole "
        "training state (keras/callbacks.py)",
    ),
    Reach(
        "keras",
        "keras.callbacks.Callback()._model",
        KERAS,
        "reading a callback's model without the JAX state sync of its model property "
        "(keras/callbacks.py)",
    ),
    Reach(
        "keras",
        "patch: keras.callbacks.CallbackList.set_model",
        KERAS,
        "putting FlushAccumulation first in every fit's callbacks when the model's optimizer "
        "accumulates, so an epoch's short last cycle is applied without a user callback "
        "(install_fit_hook, from keras/callbacks.py)",
    ),
    Reach(
        "keras",
        "frame: keras.models.clone_model calls cls(inputs, outputs, name=...) from a function "
        "named *clone* whose local 'model' is the model cloned",
        KERAS,
        "cloning a GradientAccumulateModel with its accumulation settings "
        "(model_being_cloned, from keras/model.py)",
    ),
    Reach(
        "keras",
        "frame: keras.optimizers.LossScaleOptimizer.__init__ sets inner_optimizer."
        "loss_scale_factor = None with the LossScaleOptimizer as its local 'self'",
        KERAS,
        "the optimizer wrapper learning that a LossScaleOptimizer wraps it "
        "(loss_scale_optimizer_wrapping, from keras/optimizer.py)",
    ),
    Reach(
        "keras",
        "keras.optimizers.Optimizer.apply = _filter_empty_gradients, "
        "_overwrite_variables_directly_with_gradients, loss_scale_factor, "
        "_backend_apply_gradients, constraints, then iterations + 1",
        KERAS,
        "the inner update in a conditional under a tf.distribute strategy without merge_call "
        "(apply_uncounted, from keras/_replica_shell.py)",
    ),
    Reach(
        "jax",
        "jax.jit(f).trace(*values).jaxpr: ClosedJaxpr.jaxpr.invars / outvars / eqns / effects "
        "(each eqn's invars, outvars), jax.extend.core.Literal",
        "0.10.2",
        "splitting the JAX step's inner update into one conditional per variable's slots on a "
        "CPU, by what each output reads (keras/_jax_groups.py, keras/_jax_shell.py)",
    ),
    Reach(
        "tensorflow",
        "tensorflow.python.ops.control_flow_switch_case._indexed_case_helper("
        "branch_fns, default, branch_index, name, lower_using_switch_merge=False)",
        "2.21.0",
        "the TensorFlow step's boundary conditional as a call of its branch "
        "(switch_case, from keras/_tf_shell.py)",
    ),
    Reach(
        "tensorflow",
        "tf.__internal__.distribute.strategy_supports_no_merge_call()",
        "2.21.0",
        "telling whether a tf.distribute strategy's update runs without merge_call, which "
        "decides how the boundary's inner update is counted (keras/_replica_shell.py)",
    ),
    Reach(
        "tensorflow",
        "tensorflow.python.distribute.device_util.current()",
        "2.21.0",
        "the destination of the boundary's one packed all-reduce of the clipped cycle's "
        "accumulators under a strategy with merge_call (keras/_replica_shell.py)",
    ),
    Reach(
        "keras",
        "patch: keras.optimizers.Optimizer()._all_reduce_sum_gradients (TensorFlow backend; "
        "an instance attribute set for one apply, then removed)",
        KERAS,
        "handing the inner optimizer (and each optimizer it wraps) gradients already summed "
        "over the replicas when the wrapper clips under a strategy, so they are not summed "
        "again (keras/_replica_shell.py)",
    ),
    Reach(
        "keras",
        "patch: keras.optimizers.LossScaleOptimizer(): scale_loss, apply, stateless_apply, "
        "save_own_variables, load_own_variables (instance attributes)",
        KERAS,
        "a LossScaleOptimizer wrapping the optimizer wrapper handing its loss scaling to the "
        "wrapper, which scales per cycle (_loss_scale.adopt, keras/_loss_scale.py)",
    ),
    Reach(
        "keras",
        "patch: keras.Model().train_step (instance attribute; with _plain_train_step, "
        "_weighs_batches, _batch_weight_unit and train_function = None)",
        KERAS,
        "a plain model compiled with the optimizer wrapper weighing each batch by its number "
        "of samples in fit, so the short last batch counts as it should (keras/callbacks.py)",
    ),
    Reach(
        "keras",
        "keras.Variable()._layout",
        KERAS,
        "laying out AccumBatchNormalization's statistics and the accumulators like their "
        "variables under a Keras distribution (keras/layers.py, keras/_shell.py, keras/_packed.py)",
    ),
    Reach(
        "keras",
        "keras.layers.BatchNormalization()._moments(x, mask) (reading _reduction_axes, set "
        "per call)",
        KERAS,
        "AccumBatchNormalization's micro-batch statistics, computed as BatchNormalization "
        "computes them, for inputs of any rank (keras/layers.py)",
    ),
    Reach(
        "tensorflow",
        "tensorflow.python.ops.control_flow_v2_func_graphs.ControlFlowFuncGraph (the class "
        "of tf.cond and tf.while_loop graphs)",
        "2.21.0",
        "telling a conditional's or loop's graph inside fit's step (where the step's stashed "
        "batch size may be used) from a tf.function's of the user's own (keras/_tf_shell.py)",
    ),
)


def _frames(skip: int, depth: int) -> list[FrameType]:
    """``depth`` frames from the one ``sys._getframe(skip)`` would give this module's caller."""
    frames: list[FrameType] = []
    frame: FrameType | None = sys._getframe(skip + 2)
    while frame is not None and len(frames) < depth:
        frames.append(frame)
        frame = frame.f_back
    return frames


def model_being_cloned(model_type: type, skip: int) -> Any:
    """The ``model_type`` model ``keras.models.clone_model`` is cloning, else None.

    Keras clones a functional model by calling its class with the new inputs and outputs only
    (``cls(inputs, outputs, name=...)``); the model being cloned is a local of that call's
    caller. ``skip``: the frames between the caller of this function and that call, as
    ``sys._getframe`` counts them.
    """
    for frame in _frames(skip, 4):
        model = frame.f_locals.get("model")
        if "clone" in frame.f_code.co_name and isinstance(model, model_type):
            return model
    return None


def loss_scale_optimizer_wrapping(optimizer: Any, skip: int) -> Any:
    """The ``keras.optimizers.LossScaleOptimizer`` whose constructor is wrapping ``optimizer``
    (it ends by setting ``optimizer.loss_scale_factor = None``), else None. ``skip``: as
    :func:`model_being_cloned`."""
    for frame in _frames(skip, 4):
        caller = frame.f_locals.get("self")
        if (
            isinstance(caller, keras.optimizers.LossScaleOptimizer)
            and getattr(caller, "inner_optimizer", None) is optimizer
        ):
            return caller
    return None


def install_fit_hook(on_fit: Callable[[Any, Any], None]) -> None:
    """Wrap ``keras.callbacks.CallbackList.set_model``, which every ``fit`` calls with its model,
    so that ``on_fit(callback_list, model)`` runs then (once installed, later calls do
    nothing)."""
    cls = keras.callbacks.CallbackList
    original = getattr(cls, "set_model", None)
    if original is None or getattr(original, "_fit_hook", False):
        if original is None:  # pragma: no cover - a Keras without CallbackList.set_model
            warnings.warn(
                "gradient_accumulator: this Keras version's CallbackList has no set_model; "
                "add FlushAccumulation() to fit's callbacks to apply an epoch's short last "
                "cycle",
                RuntimeWarning,
                stacklevel=2,
            )
        return

    @functools.wraps(original)
    def set_model(self: Any, model: Any) -> None:
        original(self, model)
        if model is not None and isinstance(getattr(self, "callbacks", None), list):
            on_fit(self, model)

    set_model._fit_hook = True  # type: ignore[attr-defined]
    cls.set_model = set_model


def applies_itself(optimizer: Any) -> bool:
    """Whether ``optimizer`` has its own ``apply`` (a ``LossScaleOptimizer``), which
    :func:`apply_uncounted` runs as it is, count included."""
    return type(optimizer).apply is not keras.optimizers.Optimizer.apply


def apply_uncounted(optimizer: Any, grads: list[Any], variables: list[Any]) -> None:
    """``optimizer.apply(grads, variables)`` without its ``iterations += 1``; the caller counts.

    For a branch of a conditional in a replica context without ``merge_call`` (TensorFlow runs
    a step so under XLA when every device is a GPU): the counter is a first-replica variable,
    whose update there still broadcasts through a ``merge_call``, which a branch cannot hold.
    An optimizer with its own ``apply`` (a ``LossScaleOptimizer``) is applied as it is.
    """
    if applies_itself(optimizer):
        optimizer.apply(grads, variables)
        return
    with keras.name_scope(optimizer.name, caller=optimizer):
        grads, variables = optimizer._filter_empty_gradients(grads, variables)
        grads, variables = optimizer._overwrite_variables_directly_with_gradients(grads, variables)
        if not list(grads):
            return
        scale = optimizer.loss_scale_factor
        if scale is not None:
            grads = [g if g is None else g / scale for g in grads]
        optimizer._backend_apply_gradients(grads, variables)
        for variable in variables:
            if variable.constraint is not None:
                variable.assign(variable.constraint(variable))


def switch_case(index: Any, branches: Sequence[Callable[[], None]], lowered: bool) -> None:
    """``tf.switch_case(index, branches)``; unless ``lowered``, kept as one ``Case`` op that
    calls the taken branch instead of lowered into switches and merges in the enclosing graph
    (which makes every step walk every branch's ops). Where TensorFlow no longer has the
    helper, the lowered form: the same results."""
    import tensorflow as tf

    try:
        from tensorflow.python.ops.control_flow_switch_case import _indexed_case_helper
    except ImportError:
        lowered = True
    if lowered:
        tf.switch_case(index, list(branches))
        return
    _indexed_case_helper(list(branches), None, index, "switch_case", lower_using_switch_merge=False)


def warn_deprecated(what: str, instead: str, stacklevel: int = 3) -> None:
    """Warn that ``what`` (a 0.5 argument or attribute) has no effect now; say ``instead``.

    Args:
        what: the argument or attribute, as the user wrote it.
        instead: what to do instead, one sentence.
        stacklevel: frames between the user's call and this function, plus one.
    """
    warnings.warn(
        f"{what} is deprecated (gradient-accumulator 0.5): {instead}",
        GradientAccumulatorDeprecationWarning,
        stacklevel=stacklevel,
    )


def after(tensors: Sequence[Any]) -> Any:
    """A context in which the ops created run only after ``tensors`` are computed (TensorFlow).

    In a ``tf.function`` the counter updates do not read the batch, so nothing orders them
    after the iterator's ``get_next``: on a dataset of unknown size, the step Keras runs on the
    exhausted iterator would tick them (a phantom micro-step) before the end-of-data error
    stops it. Tying them to the gradients makes every micro-step all-or-nothing.
    """
    if keras.backend.backend() != "tensorflow":
        return contextlib.nullcontext()
    import tensorflow as tf

    return tf.control_dependencies([t for t in tensors if tf.is_tensor(t)])


def to_numpy(value: Any) -> np.ndarray:
    """``value`` (a tensor, a ``keras.Variable`` or a :class:`_packed.Slot`) as a NumPy array,
    without NumPy 2's ``DeprecationWarning`` about ``__array__``.

    ``keras.Variable.__array__``, ``tf.Variable.__array__`` and torch's ``Tensor.__array__``
    do not take NumPy 2's ``copy`` keyword, and ``keras.ops.convert_to_numpy`` goes through
    them: a variable is read through its backend value, which TensorFlow and torch convert
    with their own ``numpy()``.
    """
    if isinstance(value, Slot):
        return value.numpy()
    if isinstance(value, keras.Variable):
        value = value.value
    if keras.backend.backend() == "torch":
        import torch

        if isinstance(value, torch.Tensor):
            value = value.detach().cpu()
            if value.dtype == torch.bfloat16:
                value = value.float()
            return value.numpy()
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        if isinstance(value, (tf.Variable, tf.Tensor)):
            return np.asarray(value.numpy())
    return np.asarray(keras.ops.convert_to_numpy(value))


# What differs between Keras's backends, asked by name everywhere else (the shells, chosen once
# by ``_shells.make``, hold the rest).


def tf_strategy() -> Any:
    """The active tf.distribute strategy (any number of replicas), or None for the default one
    (and on any other backend).

    A one-replica ``MirroredStrategy`` still runs the step in a replica context whose
    optimizer updates go through ``merge_call``, so it takes the distributed path too.
    """
    if keras.backend.backend() != "tensorflow":
        return None
    import tensorflow as tf

    return tf.distribute.get_strategy() if tf.distribute.has_strategy() else None


def traced(value: Any) -> bool:
    """Whether this code runs traced or compiled (``value``: a tensor of the call, for JAX)."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return not tf.executing_eagerly()
    if backend == "jax":
        import jax

        return isinstance(value, jax.core.Tracer)
    if backend == "torch":
        import torch

        return torch.compiler.is_compiling()
    return False


def checks_finite_by_sum() -> bool:
    """Whether a check that gradients are finite sums them (TensorFlow, where one reduction
    per tensor costs less than ``isfinite`` and ``all``) rather than testing each element."""
    return keras.backend.backend() == "tensorflow"


def stateless_trainer() -> bool:
    """Whether Keras's ``fit`` runs a functional step (JAX: ``train_step(state, data)``, the
    model's variables synced back by ``jax_state_sync``)."""
    return keras.backend.backend() == "jax"


def builds_optimizer_in_step() -> bool:
    """Whether Keras's ``fit`` builds the optimizer in its first step (TensorFlow without a
    strategy) rather than before it."""
    return keras.backend.backend() == "tensorflow"


def eager_trainer() -> bool:
    """Whether Keras's ``fit`` runs its step eagerly on concrete tensors (torch)."""
    return keras.backend.backend() == "torch"
