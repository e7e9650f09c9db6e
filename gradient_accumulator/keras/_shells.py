"""The shell factory: which shell runs a wrapper's cycle, chosen once, at its ``build()``.

Every choice by backend (and by ``tf.distribute`` strategy) of the wrapper's cycle is made here,
as Keras picks its backend's base classes once at import and torch's ``adam()`` its
implementation in one ``if``; the shells themselves never ask. The backend facts the rest of the
adapter needs (how ``fit`` steps, what is traced) are asked by name from ``_compat``.

=================================  ============================================================
shell                              runs
=================================  ============================================================
``_jax_shell.JaxShell``            JAX: ``stateless_apply``, packed state (``_packed``)
``_tf_shell.TensorFlowShell``      TensorFlow without a strategy: in-place folds, one
                                   conditional boundary
``_replica_shell.ReplicaShell``    TensorFlow under a ``tf.distribute`` strategy: replica-local
                                   accumulators, the boundary in the cross-replica context
``_core_path.CoreShell``           torch through the C++ core (``use_core`` not False, the core
                                   importable, no ``overwrite_with_gradient`` variable)
``_tf_shell.StatefulShell``        torch without the core: eager backend ops
=================================  ============================================================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

from gradient_accumulator import _validation
from gradient_accumulator.keras import _packed
from gradient_accumulator.keras._compat import tf_strategy
from gradient_accumulator.keras._jax_shell import JaxShell
from gradient_accumulator.keras._replica_shell import ReplicaShell
from gradient_accumulator.keras._shell import Shell
from gradient_accumulator.keras._tf_shell import StatefulShell, TensorFlowShell

_BACKEND = keras.backend.backend()


def make(opt: Any, var_list: list[Any]) -> Shell:
    """The shell of ``opt`` (being built over ``var_list``)."""
    if _BACKEND == "jax":
        return JaxShell(opt)
    if _BACKEND == "torch":
        overwrites = any(getattr(v, "overwrite_with_gradient", False) for v in var_list)
        if not overwrites and _core_enabled(opt.use_core):
            from gradient_accumulator.keras._core_path import CoreShell

            return CoreShell(opt)
        return StatefulShell(opt)
    strategy = tf_strategy()
    return TensorFlowShell(opt) if strategy is None else ReplicaShell(opt, strategy)


def takes_step_weight() -> bool:
    """Whether the shell ``make`` would choose now takes fit's batch size as a tensor of the
    step (``callbacks.weighing``), before the wrapper is built."""
    return _BACKEND == "tensorflow" and tf_strategy() is None


def checked_use_core(use_core: Any) -> bool | None:
    """The constructor's ``use_core``: None, or a bool that only the torch backend may make
    True."""
    if use_core is None:
        return None
    use_core = _validation.check_bool(use_core, "use_core")
    if use_core and _BACKEND != "torch":
        raise ValueError(f"use_core=True needs the torch backend; this Keras runs on {_BACKEND}")
    return use_core


def own_learning_rate() -> float | Callable[[], float]:
    """The wrapper's own (unused) learning rate: on JAX a callable, so that Keras makes no
    variable of it (see ``_packed``); the inner optimizer's is the one used."""
    return _packed.unused_learning_rate if _BACKEND == "jax" else 0.0


def _core_enabled(use_core: bool | None) -> bool:
    if use_core is False:
        return False
    try:
        from gradient_accumulator._loader import load_core

        load_core()
    except ImportError:
        if use_core:
            raise
        return False
    return True
