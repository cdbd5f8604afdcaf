"""SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss (gradient wrt the scores/input).

Both losses are ``sum_i w_i * l_i`` over the sample positions ``i`` (``[N, d1, ...]``), with
``w_i = weight[label_i]`` (1 without a weight input) and ``w_i = 0`` where
``label_i == ignore_index``; ``mean`` divides by ``sum_i w_i``. So the gradient of element
``(i, c)`` is ``coef_i * (softmax - onehot)`` (SCE) or ``-coef_i * onehot`` (NLL) with
``coef_i = g * w_i`` [/ ``sum w``]. Labels and weights are constants.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from .emitter import Emitter
from .native_ops import CROSS_ENTROPY_GRAD
from .registry import RuleContext, RuleError, register


def _int64(em: Emitter, labels: str) -> str:
    """``labels`` as int64 (no node when they already are)."""
    return labels if em.dtype(labels) == TensorProto.INT64 else em.op(
        "Cast", [labels], to=TensorProto.INT64)


def _onehot(em: Emitter, labels: str, scores: str, rank: int) -> str:
    """``onehot[i, c] = (labels[i] == c)`` as scores' type, class axis 1, shape [N, C, ...].

    float32: one ``OneHot`` node (an ignored label such as -100 may land on a class or
    nowhere; its sample's coefficient is 0 either way). onnxruntime has no float64 OneHot:
    there, labels are compared with a class range."""
    if em.dtype(scores) == TensorProto.FLOAT:
        values = em.const(np.array([0, 1], dtype=np.float32))
        return em.op("OneHot", [_int64(em, labels), em.dims_of(scores, 1, 2), values], "onehot",
                     axis=1)
    classes = em.squeeze(em.dims_of(scores, 1, 2), [0])
    rng = em.op("Range", [em.const(np.int64(0)), classes, em.const(np.int64(1))])
    rng = em.op("Reshape", [rng, em.ints([1, -1] + [1] * (rank - 2))])
    lab = em.unsqueeze(_int64(em, labels), [1])
    return em.cast_like(em.op("Equal", [lab, rng]), scores)


def _coefficient(ctx: RuleContext, labels: str, weights: str | None, scores: str) -> str:
    """Per-sample coefficient ``coef_i`` (shape of labels), or a scalar for sum/mean w/o weights."""
    em, g = ctx.em, ctx.dy
    reduction = ctx.attr("reduction", "mean")
    ignore = ctx.attr("ignore_index")
    w = None
    if ignore is not None:
        lab = _int64(em, labels)
        ignored = em.op("Equal", [lab, em.const(np.int64(ignore))])
        w = em.op("Where", [ignored, em.scalar(0.0, scores), em.scalar(1.0, scores)])
        if weights is not None:
            safe = em.op("Where", [ignored, em.const(np.int64(0)), lab])
            w = em.op("Mul", [w, em.op("Gather", [weights, safe], axis=0)])
    elif weights is not None:
        w = em.op("Gather", [weights, _int64(em, labels)], axis=0)
    if reduction == "none":
        return g if w is None else em.op("Mul", [g, w])
    if reduction == "sum":
        return g if w is None else em.op("Mul", [w, g])
    if reduction != "mean":
        raise RuleError(f"unknown reduction {reduction!r}")
    if w is None:
        count = em.cast_like(em.op("Size", [labels]), scores)
        return em.op("Div", [g, count])
    total = em.reduce_sum(w, list(range(ctx.rank(labels))), keepdims=False)
    return em.op("Mul", [w, em.op("Div", [g, total])])


def _scale(em: Emitter, x: str, coef: str, coef_is_per_sample: bool) -> str:
    c = em.unsqueeze(coef, [1]) if coef_is_per_sample else coef
    return em.op("Mul", [x, c])


def _per_sample(ctx: RuleContext, weights: str | None) -> bool:
    reduction = ctx.attr("reduction", "mean")
    return reduction == "none" or weights is not None or ctx.attr("ignore_index") is not None


def ignore_needs_mapping(ignore: int | None, classes: int) -> bool:
    """Whether labels equal to ``ignore`` must be mapped out of range before ``OneHot``: an
    index outside ``[-C, C)`` (torch's -100) already gives a row of zeros."""
    return ignore is not None and -classes <= ignore < classes


GATHER_FORM_CLASSES = 64  # more classes: the label's column is gathered/scattered, no one-hot


def gathers_labels(classes: int) -> bool:
    """Whether the lean loss of ``classes`` classes picks each row's label column
    (GatherElements / ScatterElements of [N, 1]) instead of a one-hot [N, C]: a language
    model's vocabulary makes the one-hot, and every pass over it, as big as the logits."""
    return classes > GATHER_FORM_CLASSES


def label_columns(op, const, labels: str, ignore: int | None, dtype) -> tuple[str, str | None]:
    """(index, kept) for the gather form: ``index`` [N, 1] int64, the label's column (0 for
    an ignored label), ``kept`` [N, 1] of ``dtype`` (1, or 0 where ignored; None without an
    ignore_index). ``op(op_type, inputs, **attrs)`` and ``const(value, np dtype)`` write the
    nodes: the lowering pass and the gradient rule write the same ones, and onnxruntime
    merges them."""
    index = op("Unsqueeze", [labels, const([1], np.int64)])
    if ignore is None:
        return index, None
    ignored = op("Equal", [index, const(ignore, np.int64)])
    kept = op("Cast", [op("Not", [ignored])], to=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))
    return op("Where", [ignored, const(0, np.int64), index]), kept


def _gathered_gradient(ctx: RuleContext, log_prob: str, labels: str, dtype) -> str:
    """``d = exp(log_prob) * c``, then ``-c`` added at each row's label column (one
    ScatterElements of [N, 1]), ``c = g [* kept] / count``."""
    em = ctx.em
    index, kept = label_columns(lambda t, i, **a: em.op(t, i, **a), lambda v, d: em.const(np.asarray(v, d)),
                                labels, ctx.attr("ignore_index"), dtype)
    c = ctx.dy
    if ctx.attr("reduction", "mean") == "mean":
        count = em.op("ReduceSum", [kept], "count", keepdims=0) if kept is not None else \
            em.cast_like(em.op("Size", [labels]), log_prob)
        c = em.op("Div", [c, count])
    c = em.op("Mul", [kept, c]) if kept is not None else em.op("Expand", [c, em.shape_of(index)])
    d = em.op("Mul", [em.op("Exp", [log_prob]), c])
    return em.op("ScatterElements", [d, index, em.op("Neg", [c])], "scatter", axis=1, reduction="add")


def cross_entropy_config(reduction: str, ignore: int | None) -> np.ndarray:
    """The int64 config input of the native cross-entropy kernels (``CE_*`` words of
    :mod:`onnx_training_ops.kernels._native_grad_kernels`): reduction (0 mean, 1 sum), whether
    there is an ignore_index, its value."""
    return np.array([0 if reduction == "mean" else 1, ignore is not None, ignore or 0], np.int64)


def _lean_gradient(ctx: RuleContext, log_prob: str) -> str | None:
    """The gradient in the terms of :mod:`~onnx_training_ops.passes.lower_cross_entropy`, for
    the form it lowers (2-D float32 scores, static class count C, int64 labels, no weights,
    mean or sum) and only the loss needing a gradient; None otherwise.

    ``hot = OneHot(labels)`` (a zero row for an ignored label) and ``count = sum(hot)`` are
    written with the lowering's very nodes, so onnxruntime merges them with the forward's::

        d = (exp(log_prob) [* sum(hot, axis=1)] - hot) * g [/ count]

    (the row sum, 1 or 0, only with an ``ignore_index``). Past :data:`GATHER_FORM_CLASSES`
    classes, the label columns instead (:func:`_gathered_gradient`); on the native path,
    ``TrainingCrossEntropyGrad(g, Exp(log_prob), labels, config)`` (the same terms, one node)."""
    em = ctx.em
    scores, labels = ctx.node.input[:2]
    shape = em.shape(scores)
    reduction = ctx.attr("reduction", "mean")
    if ctx.input(2) or ctx.grad(1) or not ctx.grad(0) or reduction not in ("mean", "sum") or \
            em.dtype(scores) != TensorProto.FLOAT or em.dtype(labels) != TensorProto.INT64 or \
            shape is None or len(shape) != 2 or not isinstance(shape[1], int):
        return None
    classes, ignore = shape[1], ctx.attr("ignore_index")
    if gathers_labels(classes):
        if ctx.opset < 16:
            return None  # ScatterElements reduction="add"
        return _gathered_gradient(ctx, log_prob, labels, np.float32)
    if CROSS_ENTROPY_GRAD in em.native:  # onnxruntime's Exp, then one pass: the same float32 terms
        config = em.const(cross_entropy_config(reduction, ignore))
        hint = f"{ctx.node.name}/dscores" if ctx.node.name else "dscores"  # an error names the loss
        prob = em.op("Exp", [log_prob])
        return em.native_op(CROSS_ENTROPY_GRAD, [ctx.dy, prob, labels, config], hint)
    index = labels
    if ignore_needs_mapping(ignore, classes):
        ignored = em.op("Equal", [labels, em.const(np.int64(ignore))])
        index = em.op("Where", [ignored, em.const(np.int64(classes)), labels])
    hot = em.op("OneHot", [index, em.const(np.array([classes], np.int64)),
                           em.const(np.array([0, 1], np.float32))], "onehot", axis=-1)
    prob = em.op("Exp", [log_prob])
    if ignore is not None:
        prob = em.op("Mul", [prob, em.reduce_sum(hot, [1], keepdims=True)])
    scale = ctx.dy
    if reduction == "mean":
        scale = em.op("Div", [scale, em.op("ReduceSum", [hot], "count", keepdims=0)])
    return em.op("Mul", [em.op("Sub", [prob, hot]), scale])


@register("SoftmaxCrossEntropyLoss")
def _softmax_cross_entropy(ctx: RuleContext) -> list:
    em = ctx.em
    scores, labels = ctx.node.input[:2]
    weights = ctx.input(2)
    rank = ctx.rank(scores)
    log_prob = ctx.output(1)
    if log_prob is None:
        if ctx.opset < 13 and rank != 2:
            raise RuleError(f"opset {ctx.opset} with rank {rank} scores: LogSoftmax cannot work "
                            "on axis 1 alone")
        log_prob = em.op("LogSoftmax", [scores], axis=1)
    lean = _lean_gradient(ctx, log_prob)
    if lean is not None:
        return [lean] + [None] * (len(ctx.node.input) - 1)
    prob = em.op("Exp", [log_prob])
    terms = []
    if ctx.grad(0):
        coef = _coefficient(ctx, labels, weights, scores)
        diff = em.op("Sub", [prob, _onehot(em, labels, scores, rank)])
        terms.append(_scale(em, diff, coef, _per_sample(ctx, weights)))
    g2 = ctx.grad(1)
    if g2:  # the log_prob output is a LogSoftmax over axis 1
        total = em.reduce_sum(g2, [1], keepdims=True)
        terms.append(em.op("Sub", [g2, em.op("Mul", [prob, total])]))
    d = terms[0] if len(terms) == 1 else em.op("Add", terms)
    return [d] + [None] * (len(ctx.node.input) - 1)


@register("NegativeLogLikelihoodLoss")
def _negative_log_likelihood(ctx: RuleContext) -> list:
    em = ctx.em
    x, target = ctx.node.input[:2]
    weights = ctx.input(2)
    coef = _coefficient(ctx, target, weights, x)
    onehot = _onehot(em, target, x, ctx.rank(x))
    d = em.op("Neg", [_scale(em, onehot, coef, _per_sample(ctx, weights))])
    return [d] + [None] * (len(ctx.node.input) - 1)
