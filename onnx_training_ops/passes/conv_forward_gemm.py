"""Pass (native path, after the Gradient expansion): a forward Conv whose weight gradient reads
native im2col columns computes its output from them: one Gemm instead of onnxruntime's Conv.

The Conv rule (:mod:`onnx_training_ops.autodiff.conv_gemm`) already builds
``cols = TrainingIm2Col(x)`` [K*C, N*P] for dW. The forward output is ``W2 @ cols`` [O, N*P]
(``W2`` the weight with rows ordered (offset, channel), as the rule orders them; the bias as
Gemm's C), put back to [N, O, *out] by a Reshape and a Transpose. onnxruntime's Conv on
ResNet-18's small feature maps took as long as both gradient Gemms together; the columns
are computed once and live from the forward to the backward pass.

Columns are the input read k*k times, so only a Conv whose columns hold at most
:data:`MAX_COLUMN_ELEMENTS`, and at least :data:`MIN_GEMM_COLUMNS` output positions (precision,
:func:`_few_columns`), is rewritten; a bigger one stays onnxruntime's Conv, and its
columns live only in the backward pass. Measured (ResNet-18, AdamW, 2 threads, interleaved
rounds, peak RSS / ms per step): at 64 x 64, batch 16 every Conv is under the cap (810 MB,
every Conv onnxruntime's: 746 MB for 1.14-1.34x the step); at 224 x 224, batch 8, without the
cap 1599 MB, with it 1331 MB for the same step (0.99x; torch eager: 1048 MB).
"""

from __future__ import annotations

import numpy as np
from onnx import ModelProto, NodeProto, TensorProto, helper, numpy_helper

from ..autodiff import topological_sort
from ..autodiff.native_ops import COLS_OF, DOMAIN, IM2COL
from ..walk import model_graphs
from ._graph import all_names, unique_name


def conv_forward_gemm(model: ModelProto) -> ModelProto:
    """Rewrite every such Conv of every graph of ``model`` (in place; returns it)."""
    for graph in model_graphs(model):
        cols = {n.doc_string[len(COLS_OF):]: n for n in graph.node
                if n.op_type == IM2COL and n.domain == DOMAIN and n.doc_string.startswith(COLS_OF)}
        if not cols:
            continue
        constants = {t.name: numpy_helper.to_array(t) for t in graph.initializer  # geometries: small, inline
                     if t.data_type == 7 and t.data_location != TensorProto.EXTERNAL}
        constants.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in graph.node
                          if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"
                          and n.attribute[0].t.data_type == 7})
        taken = all_names(graph)
        nodes: list[NodeProto] = []
        for node in graph.node:
            im2col = cols.get(node.name) if node.op_type == "Conv" and node.domain in ("", "ai.onnx") else None
            value = constants.get(im2col.input[1]) if im2col is not None else None
            geometry = None if value is None else [int(v) for v in value]
            if (im2col is None or geometry is None or im2col.input[0] != node.input[0] or _patchify(geometry)
                    or not _small(geometry) or _few_columns(geometry)):
                nodes.append(node)
                continue
            nodes += _as_gemm(node, im2col.output[0], geometry, taken)
        del graph.node[:]
        graph.node.extend(topological_sort(nodes))
    return model


MAX_COLUMN_ELEMENTS = 1 << 22  # 16 MiB of float32 columns per Conv


def _small(geometry: list[int]) -> bool:
    """The Conv's columns ``[C*kh*kw, N*oh*ow]`` hold at most :data:`MAX_COLUMN_ELEMENTS`."""
    n, c, _, _, oh, ow, kh, kw = geometry[:8]
    return n * c * kh * kw * oh * ow <= MAX_COLUMN_ELEMENTS


MIN_GEMM_COLUMNS = 256  # output positions (N*oh*ow) below which onnxruntime's Conv is kept


def _few_columns(geometry: list[int]) -> bool:
    """Fewer than :data:`MIN_GEMM_COLUMNS` output positions (the smallest feature maps of a deep
    CNN: DenseNet-121's block 4 at 1x1): there the Gemm form rounds further from float64 than
    onnxruntime's Conv, whose error equals torch float32's (3x3 convs on 1x1 maps: 1.5x the median,
    up to 2.6x the max; on 2x2 maps at 16 columns 1.9x / 3.2x; equal from 8x8), and a BatchNorm
    with 4 values a channel amplifies it past 4x torch's error (test_batchnorm_precision). Costs
    ResNet-18 1.06-1.17x at 32-64 px, where its last stages are that small; nothing at 224 px."""
    n, _, _, _, oh, ow = geometry[:6]
    return n * oh * ow < MIN_GEMM_COLUMNS


def _patchify(geometry: list[int]) -> bool:
    """A patch embedding (kernel == stride, no padding or dilation: ViT, ConvNeXt stems): its
    columns are x relaid, nothing is read twice; such a Conv stays onnxruntime's (the Gemm
    form rounds differently, and a ViT's attention-key bias gradient, exactly 0 in exact
    arithmetic, is rounding noise that the torch parity test compares to 4 ulps)."""
    kh, kw, sh, sw, ph, pw, dh, dw = geometry[6:14]
    return (kh, kw) == (sh, sw) and ph == pw == 0 and dh == dw == 1


def _as_gemm(conv, cols: str, geometry: list[int], taken: set[str]) -> list:
    """The nodes computing ``conv``'s output from ``cols``."""
    n, c, _, _, oh, ow, kh, kw = geometry[:8]
    w = conv.input[1]
    out: list = []

    def op(op_type, inputs, **attrs):
        name = unique_name(taken, f"{conv.name}/gemm_form/{op_type}")
        out.append(helper.make_node(op_type, inputs, [name], name=name, **attrs))
        return name

    def ints(values):
        name = unique_name(taken, f"{conv.name}/gemm_form/shape")
        out.append(helper.make_node("Constant", [], [name], name=name,
                                    value=numpy_helper.from_array(np.asarray(values, np.int64))))
        return name

    w2 = op("Reshape", [op("Transpose", [w], perm=[0, 2, 3, 1]), ints([0, kh * kw * c])])
    inputs = [w2, cols]
    if len(conv.input) > 2 and conv.input[2]:
        inputs.append(op("Unsqueeze", [conv.input[2], ints([1])]))  # [O, 1]: broadcast over N*P
    rows = op("Gemm", inputs)
    rows = op("Reshape", [rows, ints([0, n, oh, ow])])
    out.append(helper.make_node("Transpose", [rows], [conv.output[0]], perm=[1, 0, 2, 3],
                                name=unique_name(taken, f"{conv.name}/gemm_form/output")))
    return out
