"""MatMul (numpy semantics: batched, broadcast batch dims, rank-1 operands), Gemm, Einsum."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from .emitter import Shape
from .registry import RuleContext, RuleError, register


def _insert_one(shape: Shape, axis: int) -> Shape:
    """``shape`` with a 1 inserted at ``axis`` (negative counts from the new end)."""
    if shape is None:
        return None
    dims = list(shape)
    axis = axis if axis >= 0 else len(dims) + 1 + axis
    dims.insert(axis, 1)
    return tuple(dims)


@register("MatMul")
def _matmul(ctx: RuleContext) -> list:
    """Y = A @ B. Rank-1 operands are promoted (A: [1, k], B: [k, 1]) as numpy does, the
    gradient ``dA = g @ B^T``, ``dB = A^T @ g`` is taken in the promoted shapes, summed
    over broadcast batch dims and squeezed back. ``g @ B^T`` with the Transpose next to the
    MatMul is what onnxruntime fuses into one FusedMatMul (transB); a 2-D ``B`` gets its
    gradient from one Gemm (:func:`_weight_grad`)."""
    em, g = ctx.em, ctx.dy
    a, b = ctx.node.input[:2]
    ra, rb = ctx.rank(a), ctx.rank(b)
    a2, b2, g2 = a, b, g
    sa, sb, sg = ctx.shape(a), ctx.shape(b), ctx.shape(ctx.node.output[0])
    if rb == 1:
        b2, sb = em.unsqueeze(b, [1]), _insert_one(sb, 1)
        g2, sg = em.unsqueeze(g2, [-1]), _insert_one(sg, -1)
    if ra == 1:
        a2, sa = em.unsqueeze(a, [0]), _insert_one(sa, 0)
        g2, sg = em.unsqueeze(g2, [-2]), _insert_one(sg, -2)
    batch = None if sg is None else sg[:-2]
    out = ctx.empty()
    if ctx.need(0):
        ga = em.op("MatMul", [g2, em.swap_last_two(b2, max(rb, 2))])
        ga_shape = None if batch is None or sa is None else batch + sa[-2:]
        ga = em.unbroadcast(ga, ga_shape, a2, sa)
        out[0] = em.squeeze(ga, [0]) if ra == 1 else ga
    if ctx.need(1) and rb == 2 and ra >= 2:
        out[1] = _weight_grad(em, a, g, b)
    elif ctx.need(1):
        gb = em.op("MatMul", [em.swap_last_two(a2, max(ra, 2)), g2])
        gb_shape = None if batch is None or sb is None else batch + sb[-2:]
        gb = em.unbroadcast(gb, gb_shape, b2, sb)
        out[1] = em.squeeze(gb, [1]) if rb == 1 else gb
    return out


def _weight_grad(em, a: str, g: str, b: str) -> str:
    """dB of ``A @ B`` for a 2-D ``B`` [K, N] (a Linear layer's weight): A's leading axes
    are rows of one product, ``dB = A2^T @ g2`` with ``A2 = A`` as [M, K] and ``g2 = g`` as
    [M, N] (Reshape, no copy), one Gemm with transA. Batched products then summed over the
    batch axes would write batch x K x N and reduce it."""
    if em.rank(a) > 2:
        a = em.op("Reshape", [a, em.flat_rows(b, 0)], "rows")
        g = em.op("Reshape", [g, em.flat_rows(b, 1)], "rows")
    return em.op("Gemm", [a, g], "gemm", transA=1)


@register("Gemm")
def _gemm(ctx: RuleContext) -> list:
    """Y = alpha * A' @ B' + beta * C with A' = A^T if transA, B' = B^T if transB.

    dA' = alpha g B'^T and dB' = alpha A'^T g, each written as one Gemm that folds the
    transposes in; dC = beta g reduced to C's shape.
    """
    em, g = ctx.em, ctx.dy
    a, b = ctx.node.input[:2]
    alpha = float(ctx.attr("alpha", 1.0))
    beta = float(ctx.attr("beta", 1.0))
    ta, tb = int(ctx.attr("transA", 0)), int(ctx.attr("transB", 0))
    out = ctx.empty()
    if ctx.need(0):
        if ta:  # dA = (dA')^T = alpha B' g^T
            out[0] = em.op("Gemm", [b, g], "gemm", alpha=alpha, transA=tb, transB=1)
        else:  # dA = alpha g B'^T
            out[0] = em.op("Gemm", [g, b], "gemm", alpha=alpha, transB=1 - tb)
    if ctx.need(1):
        if tb:  # dB = (dB')^T = alpha g^T A'
            out[1] = em.op("Gemm", [g, a], "gemm", alpha=alpha, transA=1, transB=ta)
        else:  # dB = alpha A'^T g
            out[1] = em.op("Gemm", [a, g], "gemm", alpha=alpha, transA=1 - ta)
    if ctx.need(2):
        gc = g if beta == 1.0 else em.op("Mul", [g, em.scalar(beta, g if em.dtype(g) else a)])
        out[2] = _row_sum(em, gc, ctx.node.output[0], ctx.node.input[2]) or ctx.unbroadcast(gc, ctx.node.input[2])
    return out


_ROW_SUM_DTYPES = {TensorProto.FLOAT: np.float32, TensorProto.DOUBLE: np.float64}


def _row_sum(em, g: str, y: str, c: str) -> str | None:
    """A bias's gradient, ``g`` [M, N] (shaped as the Gemm's output ``y``) summed over its
    rows into C [N] or [1, N], as one ``MatMul(ones, g)`` (onnxruntime's ReduceSum over the
    leading axis of a [64, 128] gradient takes about 4 us, the product about nothing). None
    unless M, N and C's shape are static."""
    shape, c_shape, dtype = em.shape(y), em.shape(c), _ROW_SUM_DTYPES.get(em.dtype(y))
    # (a dynamic M would need the ones built at run time: three nodes, Shape, Slice, ConstantOfShape; not tried)
    if dtype is None or shape is None or len(shape) != 2 or not all(isinstance(d, int) for d in shape) \
            or c_shape not in ((shape[1],), (1, shape[1])) or shape[0] == 1:
        return None
    ones = em.const(np.ones((shape[0],) if len(c_shape) == 1 else (1, shape[0]), dtype))
    return em.op("MatMul", [ones, g], "rowsum")


def _einsum_terms(equation: str, n_inputs: int) -> tuple[list[list[str]], list[str]]:
    """Input terms and the output term as token lists ('...' is one token)."""
    eq = equation.replace(" ", "")
    lhs, _, rhs = eq.partition("->")

    def tokens(term: str) -> list[str]:
        out, i = [], 0
        while i < len(term):
            if term.startswith("...", i):
                out.append("...")
                i += 3
            else:
                out.append(term[i])
                i += 1
        return out

    terms = [tokens(t) for t in lhs.split(",")]
    if len(terms) != n_inputs:
        raise RuleError(f"equation {equation!r} names {len(terms)} operands, node has {n_inputs}")
    if "->" in eq:
        out = tokens(rhs)
    else:  # implicit output: ellipsis, then the letters used once, sorted
        flat = [t for term in terms for t in term]
        out = (["..."] if "..." in flat else []) + sorted(
            t for t in set(flat) if t != "..." and flat.count(t) == 1)
    for term in terms + [out]:
        letters = [t for t in term if t != "..."]
        if len(set(letters)) != len(letters):
            raise RuleError(f"equation {equation!r}: a letter repeated within one operand "
                            "(diagonal) has no derivative rule")
    return terms, out


@register("Einsum")
def _einsum(ctx: RuleContext) -> list:
    """d operand_i = Einsum(g, the other operands -> term_i); letters only operand i has
    (summed away in the forward pass) come back by broadcasting."""
    em, g = ctx.em, ctx.dy
    equation = ctx.attr("equation")
    inputs = list(ctx.node.input)
    terms, out_term = _einsum_terms(equation, len(inputs))
    grads: list[str | None] = []
    for i, x in enumerate(inputs):
        if not ctx.need(i):
            grads.append(None)
            continue
        others = [t for j, t in enumerate(terms) if j != i]
        available = set(out_term).union(*map(set, others)) if others else set(out_term)
        kept = [t for t in terms[i] if t in available]
        eq = ",".join("".join(t) for t in [out_term] + others) + "->" + "".join(kept)
        d = em.op("Einsum", [g] + [v for j, v in enumerate(inputs) if j != i], "einsum",
                  equation=eq)
        if len(kept) != len(terms[i]):
            if "..." in terms[i]:
                raise RuleError(f"equation {equation!r}: an operand with '...' sums away "
                                "letters of its own; not supported")
            missing = [k for k, t in enumerate(terms[i]) if t not in available]
            d = em.op("Expand", [em.unsqueeze(d, missing), em.shape_of(x)], "expand")
        grads.append(d)
    return grads
