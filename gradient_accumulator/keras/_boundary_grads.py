"""The boundary's gradients: the accumulators averaged, unscaled, clipped (AGC and the wrapper's
own clipping) and cast to their variables' dtypes, and which variables AGC clips.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import keras
from keras import ops

from gradient_accumulator.keras.agc import clip_one


def agc_mask(var_list: Sequence[Any], exclude: Any) -> list[bool]:
    """True for each variable AGC clips when ``use_agc`` is on (``exclude``: the checked
    ``agc_exclude``). Independent of ``use_agc``, which may be switched on after the build."""
    if exclude is None:
        return [True] * len(var_list)
    if exclude == "final":
        mask = [True] * len(var_list)
        last = max((i for i, v in enumerate(var_list) if len(v.shape) >= 2), default=None)
        if last is not None:
            for i in range(last, len(var_list)):
                if i == last or len(var_list[i].shape) <= 1:
                    mask[i] = False
        return mask
    ids, patterns = set(), []
    for item in exclude:
        if isinstance(item, str):
            patterns.append(re.compile(item))
        elif isinstance(item, keras.layers.Layer):
            ids.update(id(w) for w in item.weights)
        else:
            ids.add(id(item))
    return [
        not (id(v) in ids or any(p.search(getattr(v, "path", v.name)) for p in patterns))
        for v in var_list
    ]


def final_grads(
    accs: Sequence[Any],
    variables: Sequence[Any],
    params: Sequence[Any],
    scale: Any | None,
    *,
    agc: Sequence[bool] | None,
    clip_factor: float,
    eps: float,
    clip: Callable[[list[Any]], list[Any]],
) -> list[Any]:
    """Averaged, unscaled, clipped gradients in the variables' dtypes.

    ``params`` are the variables' current values (traced values on the functional path).
    ``scale`` None: ``accs`` are scaled already. ``agc``: per variable, whether AGC clips it
    (None: AGC off); ``clip``: the wrapper's own clipping (Keras's ``clipnorm`` and friends).
    ``overwrite_with_gradient`` variables (whose "gradient" is their next value) are left out
    of AGC and of the clipping, as Keras leaves them out before it clips.
    """
    grads = list(accs) if scale is None else [a * scale for a in accs]
    overwrite = [getattr(v, "overwrite_with_gradient", False) for v in variables]
    if agc is not None:
        grads = [
            clip_one(p, g, clip_factor, eps) if a and not o else g
            for p, g, a, o in zip(params, grads, agc, overwrite)
        ]
    if any(overwrite):
        ordinary = [i for i, o in enumerate(overwrite) if not o]
        if ordinary:
            for i, g in zip(ordinary, clip([grads[i] for i in ordinary])):
                grads[i] = g
    else:
        grads = clip(grads)
    return [ops.cast(g, v.dtype) for g, v in zip(grads, variables)]
