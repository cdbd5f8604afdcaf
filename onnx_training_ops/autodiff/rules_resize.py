"""Resize: every mode (nearest, linear, cubic) is linear in X and separable per axis.

For each resized axis of static size ``n -> m`` the rule builds the ``m x n`` interpolation
matrix ``M`` when the gradient graph is built, by running the same Resize (same mode,
coordinate transformation, rounding, cubic coefficient, antialias...) on the rows of an
``n x n`` identity with onnx's reference implementation, and emits ``dx = g . M`` along that
axis (a Transpose and a MatMul). Input dims and scales/sizes must be static (they are for
``torch.nn.Upsample``/``interpolate`` exports).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from .registry import RuleContext, RuleError, register

ONE_AXIS_ATTRIBUTES = ("mode", "coordinate_transformation_mode", "nearest_mode", "cubic_coeff_a",
                       "exclude_outside", "extrapolation_value", "antialias")


def interpolation_matrix(ctx: RuleContext, n: int, m: int, scale: float | None,
                         roi: tuple[float, float] | None) -> np.ndarray:
    """The ``m x n`` matrix of the node's Resize along one axis of size n -> m."""
    attrs = {a.name: helper.get_attribute_value(a) for a in ctx.node.attribute
             if a.name in ONE_AXIS_ATTRIBUTES}
    inputs = ["x", "roi", "scales", "sizes"]
    inits = [helper.make_tensor("roi", TensorProto.FLOAT, [4],
                                [0.0, roi[0], 1.0, roi[1]] if roi else [0, 0, 1, 1])]
    if scale is not None:
        inits.append(helper.make_tensor("scales", TensorProto.FLOAT, [2], [1.0, scale]))
        inputs[3] = ""
    else:
        inits.append(helper.make_tensor("sizes", TensorProto.INT64, [2], [n, m]))
        inputs[2] = ""
    graph = helper.make_graph(
        [helper.make_node("Resize", inputs, ["y"], **attrs)], "axis",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [n, n])],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, None)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", max(ctx.opset, 13))])
    model.ir_version = 8
    result = ReferenceEvaluator(model).run(None, {"x": np.eye(n)})
    assert isinstance(result, list)  # a dict only with intermediate=True
    rows = result[0]
    if rows.shape != (n, m):
        raise RuleError(f"Resize along an axis of {n}: expected {m} outputs, got {rows.shape[1]}")
    return rows.T


def _axis_values(ctx: RuleContext, rank: int) -> tuple[list[float | None], list[int | None], list[int | None]]:
    """Per axis: (static scale or None, static size or None, position in scales/sizes or None).

    A position is None for an axis the node does not resize (``axes`` attribute)."""
    if ctx.opset < 11:
        raise RuleError("Resize before opset 11 has no derivative rule")
    if (ctx.attr("keep_aspect_ratio_policy", "stretch") or "stretch") != "stretch":
        raise RuleError("keep_aspect_ratio_policy other than 'stretch' is not supported")
    axes = ctx.attr("axes")
    axes = [a + rank if a < 0 else a for a in axes] if axes else list(range(rank))
    position = [axes.index(a) if a in axes else None for a in range(rank)]

    def static(inp: int) -> list[np.generic | None]:  # per axis: the value of input ``inp`` if a constant
        value = ctx.const_value(ctx.input(inp))
        if value is None or not np.size(value):
            return [None] * rank
        flat = np.asarray(value).reshape(-1)
        return [None if p is None else flat[p] for p in position]

    sizes = [None if v is None else int(v) for v in static(3)]
    scales = [None if v is None else float(v) for v in static(2)]
    return scales, sizes, position


def _runtime_matrix_t(ctx: RuleContext, x: str, axis: int, position: int) -> str:
    """``M^T`` ([n, m]) computed at run time: the node's Resize applied to an n x n identity
    (for dims, scales or sizes only known at run time)."""
    em = ctx.em
    if ctx.attr("coordinate_transformation_mode", "half_pixel") == "tf_crop_and_resize":
        raise RuleError("tf_crop_and_resize needs static shapes and a constant roi")
    n = em.dims_of(x, axis, axis + 1)
    square = em.op("Concat", [n, n], axis=0)
    zeros = em.op("ConstantOfShape", [square], "zeros",
                  value=helper.make_tensor("v", em.known_dtype(x), [1], [0.0]))
    eye = em.op("EyeLike", [zeros], "eye")
    attrs = {a.name: helper.get_attribute_value(a) for a in ctx.node.attribute
             if a.name in ONE_AXIS_ATTRIBUTES}
    at = em.ints([position])
    sizes, scales_in = ctx.input(3), ctx.input(2)
    if sizes:
        picked = em.op("Gather", [sizes, at], axis=0)
        return em.op("Resize", [eye, "", "", em.op("Concat", [n, picked], axis=0)], "resized",
                     **attrs)
    if scales_in is None:
        raise RuleError("Resize with neither scales nor sizes")
    picked = em.op("Gather", [scales_in, at], axis=0)
    scales = em.op("Concat", [em.const(np.ones(1, np.float32)), picked], axis=0)
    return em.op("Resize", [eye, "", scales], "resized", **attrs)


@register("Resize")
def _resize(ctx: RuleContext) -> list:
    """Per resized axis: dx = g . M along that axis (M static when the shapes and
    scales/sizes are, else computed at run time by the same Resize)."""
    em, x, g = ctx.em, ctx.node.input[0], ctx.dy
    rank = ctx.rank(x)
    shape = em.known_shape(x)
    scales, sizes, position = _axis_values(ctx, rank)
    roi_v = ctx.const_value(ctx.input(1))
    crop = ctx.attr("coordinate_transformation_mode", "half_pixel") == "tf_crop_and_resize"
    if crop and roi_v is None:
        raise RuleError("tf_crop_and_resize needs a constant roi")
    dx = g
    for axis, at in enumerate(position):
        if at is None:
            continue
        n, scale, size = shape[axis], scales[axis], sizes[axis]
        static_n = isinstance(n, int)
        if static_n and size is not None:
            m = size
        elif static_n and scale is not None:
            m = int(np.floor(n * scale))
        else:
            m = None
        if m == n and not crop and (scale is None or scale == 1.0):
            continue  # identity along this axis
        if m is not None:
            roi = (float(roi_v[axis]), float(roi_v[rank + axis])) if crop and roi_v is not None else None
            matrix = interpolation_matrix(ctx, n, m, scale if size is None else None, roi)
            matrix_t = em.const(matrix.astype(helper.tensor_dtype_to_np_dtype(em.known_dtype(x))),
                                "resize_matrix")
        else:
            matrix_t = em.op("Transpose", [_runtime_matrix_t(ctx, x, axis, at)])
        perm = [i for i in range(rank) if i != axis] + [axis]
        inverse = [perm.index(i) for i in range(rank)]
        moved = em.op("Transpose", [dx], perm=perm)
        dx = em.op("Transpose", [em.op("MatMul", [moved, matrix_t])], perm=inverse)
    return [dx] + [None] * (len(ctx.node.input) - 1)
