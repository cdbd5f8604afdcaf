"""Data-movement and reduction ops: Reshape-likes, Transpose, Concat, Gather, ReduceSum/Mean.

Shape-only inputs (Reshape's ``shape``, ``axes`` tensors, Gather's indices) are integer
tensors and never receive a gradient.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from .emitter import static_dims
from .registry import RuleContext, RuleError, register
from .rules_slicing import pad_back

# Node metadata on an axis-0 Gather: torch's nn.Embedding(padding_idx=...), the table row whose
# lookups give it no gradient (written by the builder, onnx_training_ops.builder.padding_rows).
PADDING_ROW_KEY = "onnx_training_ops.padding_idx"


def padding_row(node) -> int | None:
    """The padding row a Gather node's metadata names (:data:`PADDING_ROW_KEY`), or None."""
    value = next((m.value for m in node.metadata_props if m.key == PADDING_ROW_KEY), None)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise RuleError(f"Gather node {node.name!r}: metadata {PADDING_ROW_KEY} must be an integer row, "
                        f"found {value!r}") from None


@register("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def _reshape(ctx: RuleContext) -> list:
    x = ctx.node.input[0]
    return [ctx.em.reshape_like(ctx.dy, x)] + [None] * (len(ctx.node.input) - 1)


@register("Transpose")
def _transpose(ctx: RuleContext) -> list:
    perm = ctx.attr("perm")
    if perm is None:  # default: reverse the axes, its own inverse
        return [ctx.em.op("Transpose", [ctx.dy])]
    inverse = [0] * len(perm)
    for i, p in enumerate(perm):
        inverse[p] = i
    return [ctx.em.op("Transpose", [ctx.dy], perm=inverse)]


@register("Concat")
def _concat(ctx: RuleContext) -> list:
    """Split the gradient along ``axis`` into pieces the size of each input."""
    em, inputs = ctx.em, list(ctx.node.input)
    axis = int(ctx.attr("axis"))
    if axis < 0:
        axis += ctx.rank(inputs[0])
    sizes = []
    for x in inputs:
        s = ctx.shape(x)
        sizes.append(s[axis] if s is not None and isinstance(s[axis], int) else None)
    static = [s for s in sizes if s is not None]
    if len(static) == len(sizes):
        split = static
        split_t = em.ints(static)
    elif ctx.opset >= 13:
        split = None
        split_t = em.op("Concat", [em.dims_of(x, axis, axis + 1) for x in inputs], axis=0)
    else:
        raise RuleError(f"opset {ctx.opset} Concat gradient needs static input sizes")
    if ctx.opset >= 13:
        parts = em.op_n("Split", [ctx.dy, split_t], len(inputs), "split", axis=axis)
    else:
        parts = em.op_n("Split", [ctx.dy], len(inputs), "split", axis=axis, split=split)
    return [p if ctx.need(i) else None for i, p in enumerate(parts)]


def _gathered_window(ctx: RuleContext, axis: int) -> tuple[int, int] | None:
    """(first, count) when Gather's indices are constants naming consecutive positions
    ``first, first + 1, ...`` on a static axis (a scalar index is a window of one)."""
    known = ctx.const_value(ctx.node.input[1])
    shape = ctx.shape(ctx.node.input[0])
    if known is None or shape is None or not isinstance(shape[axis], int) or np.asarray(known).size == 0:
        return None
    flat = np.asarray(known, dtype=np.int64).reshape(-1)
    flat = np.where(flat < 0, flat + shape[axis], flat)
    if not np.array_equal(flat, np.arange(flat[0], flat[0] + flat.size)):
        return None
    return int(flat[0]), int(flat.size)


@register("Gather")
def _gather(ctx: RuleContext) -> list:
    """Indices that are a constant window of consecutive positions (``x[:, 0]``, a slice
    written as a Gather): the gradient padded back with zeros, one Pad. Others: scatter-add
    the gradient rows back into zeros shaped like ``data`` on the gathered axis (ScatterND
    with ``reduction="add"``, opset >= 16), so repeated indices accumulate. A padding row in
    the node's metadata (:data:`PADDING_ROW_KEY`, axis 0): the positions looking it up add
    nothing, as torch's ``embedding_backward``."""
    em, g = ctx.em, ctx.dy
    data = ctx.node.input[0]
    axis = int(ctx.attr("axis", 0))
    if axis < 0:
        axis += ctx.rank(data)
    padding = padding_row(ctx.node) if axis == 0 else None
    window = _gathered_window(ctx, axis) if padding is None else None
    if window is not None:
        first, count = window
        r = ctx.rank(data)
        dim = em.known_shape(data)[axis]
        if ctx.rank(ctx.node.input[1]) != 1:  # the indices' axes folded into one axis of `count`
            window_dims = list(em.known_shape(data))
            window_dims[axis] = count
            target = em.ints(window_dims) if static_dims(tuple(window_dims)) is not None else em.op("Concat", [
                em.dims_of(data, 0, axis), em.ints([count]), em.dims_of(data, axis + 1)], "dims", axis=0)
            g = em.op("Reshape", [g, target], "window")
        return [pad_back(em, g, r, {axis: first}, {axis: dim - first - count}), None]
    if ctx.opset < 16:
        raise RuleError(f"the Gather gradient needs ScatterND reduction='add' (opset >= 16), "
                        f"graph has opset {ctx.opset}")
    indices = ctx.node.input[1]
    idx = indices if em.dtype(indices) == TensorProto.INT64 else em.op(
        "Cast", [indices], "idx", to=TensorProto.INT64)
    known = ctx.const_value(indices)
    if known is None or (np.asarray(known) < 0).any():  # Gather allows negative indices
        dim = em.squeeze(em.dims_of(data, axis, axis + 1), [0])
        negative = em.op("Less", [idx, em.const(np.int64(0))])
        idx = em.op("Where", [negative, em.op("Add", [idx, dim]), idx])
    idx = em.unsqueeze(idx, [-1])
    if padding is not None:  # [*ids, 1] against g [*ids, *row]: a table of rank 2 broadcasts as it is
        is_pad = em.op("Equal", [idx, em.const(np.int64(padding))], "padding")
        r = ctx.rank(data)
        if r > 2:
            q = ctx.rank(indices)
            is_pad = em.unsqueeze(is_pad, list(range(q + 1, q + r - 1)))
        zero = em.const(np.zeros((), helper.tensor_dtype_to_np_dtype(em.known_dtype(data))))
        g = em.op("Where", [is_pad, zero, g], "padding_masked")
    if axis == 0:
        zeros = em.filled_like(0.0, data)
        return [em.op("ScatterND", [zeros, idx, g], "scatter", reduction="add"), None]
    r, q = ctx.rank(data), ctx.rank(indices)
    # Move the gathered axis to the front, scatter there, move it back.
    perm_d = [axis] + [i for i in range(r) if i != axis]
    inv_d = [perm_d.index(i) for i in range(r)]
    perm_g = list(range(axis, axis + q)) + list(range(axis)) + list(range(axis + q, r + q - 1))
    gt = em.op("Transpose", [g], perm=perm_g)
    s = ctx.shape(data)
    dims = static_dims(s)
    if dims is not None:
        shape_t = em.ints([dims[p] for p in perm_d])
    else:
        shape_t = em.op("Gather", [em.shape_of(data), em.ints(perm_d)], "dims", axis=0)
    dt = em.dtype(data)
    if dt is None:
        raise RuleError(f"element type of {data!r} unknown")
    zeros = em.op("ConstantOfShape", [shape_t], "zeros", value=numpy_helper.from_array(
        np.zeros(1, dtype=helper.tensor_dtype_to_np_dtype(dt))))
    scattered = em.op("ScatterND", [zeros, idx, gt], "scatter", reduction="add")
    return [em.op("Transpose", [scattered], perm=inv_d), None]


def reduce_axes(ctx: RuleContext, attr_form: bool):
    """(axes, noop): axes as a static list, a tensor name, or None for "all axes"."""
    if attr_form:
        axes = ctx.attr("axes")
        return (list(axes) if axes else None), False
    noop = bool(ctx.attr("noop_with_empty_axes", 0))
    name = ctx.input(1)
    if name is None:
        return None, noop
    value = ctx.const_value(name)
    if value is not None:
        axes = [int(v) for v in np.asarray(value).reshape(-1)]
        return (axes or None), noop
    return name, noop


def _reduce_grad(ctx: RuleContext, attr_form: bool, mean: bool) -> list:
    em, g, x = ctx.em, ctx.dy, ctx.node.input[0]
    axes, noop = reduce_axes(ctx, attr_form)
    rest = [None] * (len(ctx.node.input) - 1)
    if axes is None and noop:
        return [g] + rest
    keepdims = bool(ctx.attr("keepdims", 1))
    gk = g
    if not keepdims and axes is not None:
        gk = em.unsqueeze(g, axes)
    gx = em.op("Expand", [gk, em.shape_of(x)], "expand")
    if not mean:
        return [gx] + rest
    xs, ys = static_dims(ctx.shape(x)), static_dims(ctx.shape(ctx.node.output[0]))
    if xs is not None and ys is not None:
        count = float(np.prod(xs, dtype=np.int64)) / max(float(np.prod(ys, dtype=np.int64)), 1.0)
        scale = em.scalar(1.0 / count if count else 0.0, x)
    else:
        scale = em.op("Div", [em.cast_like(em.op("Size", [ctx.node.output[0]]), x),
                              em.cast_like(em.op("Size", [x]), x)])
    return [em.op("Mul", [gx, scale])] + rest


@register("ReduceSum")
def _reduce_sum(ctx: RuleContext) -> list:
    return _reduce_grad(ctx, attr_form=ctx.opset < 13, mean=False)


@register("ReduceMean")
def _reduce_mean(ctx: RuleContext) -> list:
    return _reduce_grad(ctx, attr_form=ctx.opset < 18, mean=True)
