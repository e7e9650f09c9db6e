"""Which outputs of the JAX cycle's inner update may each go in a conditional of their own.

At a boundary the inner optimizer's update runs in a ``lax.cond``. XLA's CPU runtime runs a
branch of more than eight operations (unless all its buffers are of at most 512 bytes) with an
executor of its own, and that executor hands the operations that are ready at the same time to
other threads (``thunk_executor.cc``). An optimizer's per-variable updates are all ready when
the branch starts, so a small model paid a thread handover per update at every boundary: on
one core, a context switch each (benchmarks/README.md). One conditional per variable's own
slots keeps each branch small enough to run in the calling thread.

The split is read off the update's jaxpr, so it holds for any inner optimizer:

- outputs that read or write the same array stay in one group (two conditionals that touch one
  buffer make XLA copy it); a scalar may be read across groups (its copy costs nothing);
- an update that couples the variables (a global norm over every gradient) stays whole;
- an output that returns its input unchanged needs no conditional;
- an update with effects (a print, a host callback) stays whole, so they run once.

Every group's branch computes the same update, pruned by XLA to the group's outputs: the same
operations on the same values. They are bit for bit those of one conditional for the optimizers
tested (Adam, AdamW, SGD with momentum, Lion, RMSprop, a global norm, AGC). Where every group
recomputes a scalar the update writes, XLA may fuse it differently in each branch: Nadam's
product of momentum factors, whose weights then differ from one conditional's by about 1 ulp.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# More groups than this and the update stays in one conditional. Each branch holds the whole
# update until XLA prunes it, so compile time grows with the count; and a model of many
# variables has larger operations, where a handover to another thread costs relatively less.
MAX_GROUPS = 16


def write_groups(
    jaxpr: Any, read_sizes: Sequence[int], state_sizes: Sequence[int], max_groups: int = MAX_GROUPS
) -> list[list[int]] | None:
    """Groups of the update's outputs for separate conditionals; None: one conditional (fewer
    than two groups, more than ``max_groups``, an update with effects, or inputs other than
    those described here).

    ``jaxpr``: the update as a closed jaxpr. Its inputs are ``len(read_sizes)`` arrays it only
    reads, then the state (``len(state_sizes)`` arrays); its outputs are the state's new values,
    in the same order. The sizes are element counts. A group lists output indices, in order.
    """
    try:
        from jax.extend.core import Literal
    except ImportError:  # an older JAX: one conditional
        return None
    inner = jaxpr.jaxpr
    n_read, n_state = len(read_sizes), len(state_sizes)
    if len(inner.invars) != n_read + n_state or len(inner.outvars) != n_state:
        # Values the update closes over (a tracer of the caller's function, read by a
        # learning-rate schedule) come first as inputs of their own: one conditional.
        return None
    if inner.effects:
        return None  # a print or callback in the update would run once per conditional
    # Which inputs each value depends on, as a bit set over the inputs. An equation's outputs
    # depend on all its inputs (a nested jaxpr included): coarse, never wrong.
    deps: dict[Any, int] = {v: 1 << i for i, v in enumerate(inner.invars)}

    def of(v: Any) -> int:
        return 0 if isinstance(v, Literal) else deps.get(v, 0)

    for eqn in inner.eqns:
        d = 0
        for v in eqn.invars:
            d |= of(v)
        for v in eqn.outvars:
            deps[v] = d
    # Union-find over the arrays: the state's (index i: input i and output i) and the
    # read-only ones (index n_state + r).
    sizes = list(state_sizes) + list(read_sizes)
    parent = list(range(n_state + n_read))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    written = []
    for o, v in enumerate(inner.outvars):
        if v is inner.invars[n_read + o]:
            continue  # passed through: not written
        written.append(o)
        d = of(v)
        while d:
            i = (d & -d).bit_length() - 1  # the lowest input it reads
            d &= d - 1
            node = n_state + i if i < n_read else i - n_read
            if sizes[node] > 1:
                parent[find(node)] = find(o)
    groups: dict[int, list[int]] = {}
    for o in written:
        groups.setdefault(find(o), []).append(o)
    found = sorted(groups.values())
    return found if 2 <= len(found) <= max_groups else None
