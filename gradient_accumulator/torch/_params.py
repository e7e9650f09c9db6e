"""What the optimizer wrapper checks about the parameters it is given (once, up front) and about
a checkpoint it is asked to load (before anything is loaded)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from gradient_accumulator import core


def parameter_names(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None) -> list[str]:
    """How errors name each parameter: its name in ``model``, else its group and index."""
    named = {}
    if model is not None:
        named = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    names = []
    for g, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            names.append(
                repr(named[id(p)]) if id(p) in named else f"param_groups[{g}]['params'][{j}]"
            )
    return names


def check_parameters(params: Sequence[torch.Tensor], names: Sequence[str]) -> None:
    """Refuse parameters the accumulator buffer cannot hold (raised before anything is built)."""
    if not params:
        raise ValueError("optimizer has no parameters")
    if len({id(p) for p in params}) != len(params):
        raise ValueError("a parameter appears twice in the optimizer's param_groups")
    for i, p in enumerate(params):
        if p.device.type not in ("cpu", "cuda"):
            raise TypeError(
                f"parameter {names[i]} is on {p.device}; gradient-accumulator runs on CPU and "
                "CUDA tensors"
                + (
                    " (a model built on the meta device must be materialised first, e.g. "
                    "model.to_empty(device=...) then its initialisation)"
                    if p.device.type == "meta"
                    else ""
                )
            )
        if p.device.type != "cpu" and not core.has_cuda():
            raise TypeError(
                f"parameter {names[i]} is on {p.device}, but this build of "
                "gradient-accumulator has no CUDA kernels (rebuild with GA_CUDA=ON)"
            )
        if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"parameter {names[i]} has dtype {p.dtype}; expected float32/bf16/fp16")
        if p.device != params[0].device:
            raise ValueError(
                f"parameter {names[i]} is on {p.device}, parameter {names[0]} on "
                f"{params[0].device}: one wrapper holds parameters of one device"
            )
    check_layout(params, names)


def check_shapes(
    tensors: Sequence[torch.Tensor | None],
    shapes: Sequence[tuple[int, ...]],
    names: Sequence[str],
    what: str = "it",
) -> None:
    """Refuse a parameter (or its ``.grad``: ``what="its .grad"``) whose shape is no longer the
    one its accumulator was laid out for when the optimizer was wrapped — resized, or reshaped
    to the same element count — naming the parameter (nothing written yet).

    Raises:
        ValueError: naming the first such parameter, its shape then and now.
    """
    for i, (t, shape) in enumerate(zip(tensors, shapes)):
        if t is not None and t.shape != shape:
            raise ValueError(
                f"parameter {names[i]} (shape {tuple(shape)}) changed shape since the optimizer "
                f"was wrapped: {what} has shape {tuple(t.shape)}. Its accumulator keeps the "
                "shape it was wrapped with; resize parameters before wrapping the optimizer, or "
                "wrap it again (nothing was changed)"
            )


def strides(params: Sequence[torch.Tensor]) -> list[tuple[int, ...] | None]:
    """Each parameter's strides, None for C-contiguous ones."""
    return [None if p.is_contiguous() else p.stride() for p in params]


def same_layouts(params: Sequence[torch.Tensor], layouts: Sequence[Any]) -> bool:
    """Whether every parameter still has the layout it was wrapped with."""
    return all(p.is_contiguous() if s is None else p.stride() == s for p, s in zip(params, layouts))


def _dense(p: torch.Tensor) -> bool:
    """Whether ``p``'s elements fill one span without gaps or overlaps (any dimension order)."""
    dims = sorted((st, n) for st, n in zip(p.stride(), p.shape) if n != 1)
    expected = 1
    for st, n in dims:
        if st != expected:
            return False
        expected *= n
    return True


def check_layout(
    params: Sequence[torch.Tensor],
    names: Sequence[str],
    wrapped: Sequence[Any] | None = None,
) -> None:
    """Refuse now what the core would refuse at the first update (nothing written yet): a
    parameter that is not one dense span, one whose layout changed since it was wrapped
    (``wrapped``: the strides it had then, None for C-contiguous), two sharing memory."""
    spans = []
    for i, p in enumerate(params):
        if not p.is_contiguous() and not _dense(p):
            raise ValueError(
                f"parameter {names[i]} is not contiguous (strides {p.stride()} for shape "
                f"{tuple(p.shape)}): the update takes each parameter as one dense span of memory "
                "(C-contiguous or a permutation such as channels-last); pass a dense parameter"
            )
        if wrapped is not None:
            was = wrapped[i]
            if (p.is_contiguous() if was is None else p.stride() == was) is False:
                fmt = "channels-last" if _channels_last(p) else f"of strides {p.stride()}"
                raise ValueError(
                    f"parameter {names[i]} is {fmt} since it was wrapped; its accumulator keeps "
                    "the layout the parameter had then (convert the model back, or convert it "
                    "before wrapping the optimizer)"
                )
        if p.numel():
            start = p.data_ptr()
            spans.append((start, start + p.numel() * p.element_size(), i))
    spans.sort()
    for (_, end_a, a), (start_b, _, b) in zip(spans, spans[1:]):
        if start_b < end_a:
            first, second = sorted((a, b))
            raise ValueError(
                f"parameters {names[first]} and {names[second]} share memory; "
                "each parameter must own its storage (tie weights by using one Parameter "
                "object, which the optimizer then holds once)"
            )


def _channels_last(p: torch.Tensor) -> bool:
    return p.dim() in (4, 5) and (
        p.is_contiguous(memory_format=torch.channels_last)
        or p.is_contiguous(memory_format=torch.channels_last_3d)
    )


def check_agc_layout(
    params: Sequence[torch.Tensor], names: Sequence[str], skip: set[int] | None
) -> None:
    """Refuse, for adaptive clipping, a parameter whose units (slices of its first dimension)
    are not consecutive in memory: dense layouts whose first dimension is not the outermost."""
    if skip is None:
        return
    for i, p in enumerate(params):
        if i in skip or p.dim() < 2 or p.is_contiguous() or p.shape[0] == 1:
            continue
        if p.stride(0) * p.shape[0] != p.numel():
            raise ValueError(
                f"parameter {names[i]} (strides {p.stride()} for shape {tuple(p.shape)}) does not "
                "keep its first dimension outermost in memory, so its adaptive-clipping units "
                "(slices of that dimension) are not consecutive; make it contiguous or leave it "
                "out of AGC (agc_exclude)"
            )


def dense_grad(g: torch.Tensor, p: torch.Tensor, name: str) -> torch.Tensor:
    """A parameter's ``.grad`` as the core takes it, or a clear error naming the parameter."""
    if g.is_sparse:
        raise TypeError(f"parameter {name} has a sparse gradient, which is not supported")
    if g.shape != p.shape:
        raise ValueError(
            f"parameter {name}'s .grad has shape {tuple(g.shape)}, not {tuple(p.shape)}"
        )
    g = g.detach()
    if p.is_contiguous():
        return g if g.is_contiguous() else g.contiguous()
    # A dense non-contiguous parameter (channels-last): the gradient in the same layout.
    return g if g.stride() == p.stride() else torch.empty_like(p, dtype=g.dtype).copy_(g)


def accumulator_buffer(
    params: Sequence[torch.Tensor], bucket_cap_mb: float, scalar_slots: int
) -> tuple[torch.Tensor, Any, int, list[torch.Tensor]]:
    """One flat fp32 buffer for all accumulators, laid out in backward order and cut into
    buckets of ``bucket_cap_mb`` MiB, followed by a tail: ``scalar_slots`` elements, then one
    "seen" flag per parameter (a multiple of 16 elements, for 64-byte alignment).

    Returns:
        ``(flat, plan, tail, accumulators)``: the buffer, its ``core.arena_plan``, the tail's
        length and one view of the buffer per parameter, shaped like it.
    """
    plan = core.arena_plan(
        [p.numel() for p in params], bucket_numel=max(1, int(bucket_cap_mb * 2**18))
    )
    tail = scalar_slots + -(-len(params) // 16) * 16
    flat = torch.zeros(plan.total + tail, dtype=torch.float32, device=params[0].device)
    # Each accumulator is laid out like its parameter (channels-last stays channels-last), so
    # that parameter, gradient, accumulator and optimizer state pair up element for element.
    accs = [
        flat[o : o + p.numel()].view_as(p)
        if p.is_contiguous()
        else flat.as_strided(p.shape, p.stride(), o)
        for o, p in zip(plan.offsets, params)
    ]
    return flat, plan, tail, accs


def layout_fingerprint(optimizer: torch.optim.Optimizer, numel: int) -> str:
    """A digest of what the accumulator buffer's layout depends on (shapes, dtypes, groups)."""
    h = hashlib.sha256()
    for group in optimizer.param_groups:
        h.update(b"|group")
        for p in group["params"]:
            h.update(f"{tuple(p.shape)}:{p.dtype};".encode())
    h.update(f"|{numel}".encode())
    return h.hexdigest()[:16]


def agc_excluded(params: Sequence[torch.Tensor], exclude: str | Iterable[Any]) -> set[int]:
    """Indices of the parameters adaptive clipping leaves alone (see ``agc_exclude``)."""
    if isinstance(exclude, str):
        if exclude != "final":
            raise ValueError(f"agc_exclude must be 'final' or an iterable, got {exclude!r}")
        last = max((i for i, p in enumerate(params) if p.dim() >= 2), default=None)
        if last is None:
            return set()
        return {last} | {i for i in range(last + 1, len(params)) if params[i].dim() <= 1}
    index = {id(p): i for i, p in enumerate(params)}
    skip: set[int] = set()
    for item in exclude:
        tensors = list(item.parameters()) if isinstance(item, torch.nn.Module) else [item]
        for t in tensors:
            if id(t) not in index:
                raise ValueError("agc_exclude names a parameter the optimizer does not hold")
            skip.add(index[id(t)])
    return skip


_SAVED = ("layout", "accum_steps", "reduction", "micro_step", "total_weight", "nonfinite")
_SAVED += ("updates", "seen", "accumulators")


def check_saved(
    state_dict: Any,
    *,
    layout: str,
    flat: torch.Tensor,
    accum_steps: int,
    reduction: str,
    groups: list[int],
) -> None:
    """Refuse a ``state_dict`` of another model (a different layout fingerprint, even with a
    buffer of the same size), of other settings, or with entries missing or of the wrong kind.

    Raises:
        ValueError: saying which.
    """
    if not isinstance(state_dict, dict) or "optimizer" not in state_dict:
        raise ValueError("state_dict was not produced by GradientAccumulateOptimizer")
    acc = state_dict.get("accumulation")
    if not isinstance(acc, dict):
        raise ValueError(
            "state_dict has no 'accumulation' entry (not produced by "
            "GradientAccumulateOptimizer, or truncated)"
        )
    missing = [k for k in _SAVED if k not in acc]
    if missing:
        raise ValueError(
            f"state_dict['accumulation'] lacks {missing} (truncated, or saved by an older version)"
        )
    if acc["layout"] != layout:
        raise ValueError(
            f"state_dict was saved for another parameter layout (fingerprint "
            f"{acc['layout']!r}, this optimizer's is {layout!r}): the parameters' "
            "shapes, dtypes or groups differ"
        )
    saved = acc["accumulators"]
    if not (
        isinstance(saved, torch.Tensor)
        and saved.dtype == torch.float32
        and saved.shape == flat.shape
    ):
        raise ValueError("state_dict's accumulators do not match this optimizer's parameters")
    if acc["accum_steps"] != accum_steps or acc["reduction"] != reduction:
        raise ValueError(
            "state_dict was saved with accum_steps/reduction "
            f"{acc['accum_steps']}/{acc['reduction']}, this optimizer uses "
            f"{accum_steps}/{reduction}"
        )
    inner = state_dict["optimizer"]
    if not (
        isinstance(inner, dict)
        and isinstance(inner.get("param_groups"), list)
        and isinstance(inner.get("state"), dict)
    ):
        raise ValueError("state_dict['optimizer'] is not an optimizer state dict")
    sizes = [len(g.get("params", ())) for g in inner["param_groups"]]
    if sizes != groups:
        raise ValueError(
            f"state_dict['optimizer'] has groups of {sizes} parameters, the inner optimizer "
            f"{groups}"
        )
