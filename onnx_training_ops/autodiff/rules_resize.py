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

from .emitter import static_dims
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
    rows = ReferenceEvaluator(model).run(None, {"x": np.eye(n)})[0]
    if rows.shape != (n, m):
        raise RuleError(f"Resize along an axis of {n}: expected {m} outputs, got {rows.shape[1]}")
    return rows.T


def _per_axis(ctx: RuleContext, rank: int) -> tuple[list, list]:
    """(scales or None per axis, sizes or None per axis) from the node's constant inputs."""
    if ctx.opset < 11:
        raise RuleError("Resize before opset 11 has no derivative rule")
    axes = ctx.attr("axes")
    axes = [a + rank if a < 0 else a for a in axes] if axes else list(range(rank))
    if (ctx.attr("keep_aspect_ratio_policy", "stretch") or "stretch") != "stretch":
        raise RuleError("keep_aspect_ratio_policy other than 'stretch' is not supported")
    scales_v = ctx.const_value(ctx.input(2)) if ctx.input(2) else None
    sizes_v = ctx.const_value(ctx.input(3)) if ctx.input(3) else None
    if (ctx.input(2) and scales_v is None) or (ctx.input(3) and sizes_v is None):
        raise RuleError("Resize scales/sizes must be constants")
    scales, sizes = [None] * rank, [None] * rank
    if sizes_v is not None and np.size(sizes_v):
        for a, v in zip(axes, np.asarray(sizes_v).reshape(-1)):
            sizes[a] = int(v)
    elif scales_v is not None and np.size(scales_v):
        for a, v in zip(axes, np.asarray(scales_v).reshape(-1)):
            scales[a] = float(v)
    else:
        raise RuleError("Resize needs constant scales or sizes")
    return scales, sizes


@register("Resize")
def _resize(ctx: RuleContext) -> list:
    em, x, g = ctx.em, ctx.node.input[0], ctx.grad(0)
    dims = static_dims(ctx.shape(x))
    if dims is None:
        raise RuleError(f"Resize needs the static shape of {x!r}")
    rank = len(dims)
    scales, sizes = _per_axis(ctx, rank)
    roi_v = ctx.const_value(ctx.input(1)) if ctx.input(1) else None
    crop = ctx.attr("coordinate_transformation_mode", "half_pixel") == "tf_crop_and_resize"
    if crop and roi_v is None:
        raise RuleError("tf_crop_and_resize needs a constant roi")
    dx = g
    for axis, n in enumerate(dims):
        scale, size = scales[axis], sizes[axis]
        m = size if size is not None else (int(np.floor(n * scale)) if scale is not None else n)
        if m == n and not crop and (scale is None or scale == 1.0):
            continue
        roi = (float(roi_v[axis]), float(roi_v[rank + axis])) if crop else None
        matrix = interpolation_matrix(ctx, n, m, scale if size is None else None, roi)
        dt = em.dtype(x)
        matrix_t = em.const(matrix.astype(helper.tensor_dtype_to_np_dtype(dt)), "resize_matrix")
        perm = [i for i in range(rank) if i != axis] + [axis]
        inverse = [perm.index(i) for i in range(rank)]
        moved = em.op("Transpose", [dx], perm=perm)
        dx = em.op("Transpose", [em.op("MatMul", [moved, matrix_t])], perm=inverse)
    return [dx] + [None] * (len(ctx.node.input) - 1)
