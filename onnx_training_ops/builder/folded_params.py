"""A constant the exporter computed from a parameter, computed from the parameter again.

Exporters fold computations on weights into constants: the dynamo exporter's optimizer
(``optimize=True``) folds every computation on parameters and buffers alone (``emb.weight.t()``,
``torch.exp(log_s)``, ``w.sum(0)``, a position embedding looked up with constant ids, a class
token expanded to the batch), the TorchScript exporter's ``do_constant_folding=True`` the data
movement among them (``Transpose``, ``Gather``, ``Reshape``). The constant holds the value at
export time and nothing trains through it: the parameter gets no gradient from that use.

:func:`find_recipe` finds *how* a constant ``c`` was computed from a parameter ``p`` by
value, among the forms these folds take, and :func:`emit` writes that computation as ONNX
nodes reading the parameter, so its gradient flows again:

* data movement (``Recipe.kind == "select"``): ``c`` is a rearrangement of ``p``'s values: a
  transpose/permutation and reshape of the whole tensor, a broadcast (``expand``), or rows of
  ``p`` looked up along its first axis (embedding lookups with constant ids, a relative
  position table indexed by a constant; the rows may lie along any axis of ``c``). Matched
  exactly; rows of ``p`` that repeat are ambiguous (which row's gradient?) and refuse;
* arithmetic (``"unary"``, ``"reduce"``): one elementwise function (``Exp``, ``Log``,
  ``Sigmoid``...) or a ``ReduceSum``/``ReduceMean`` over some axes, optionally followed by
  ``a * x + b`` with scalars (``w.sum(0) * 0.1``, Gemma's ``1 + w``). Matched to float32
  rounding; a match that another form matches too (a tensor of zeros or of one repeated value)
  is ambiguous and refuses.

:func:`invert` goes the other way for a parameter the export no longer holds: ``exp``,
``t``... of a parameter alone, named by the fx node the constant replaced, give the
parameter's value back (``log(c)``, ``c.T``).

Anything else (several parameters in one constant, a LayerNorm of an embedding table) has no
recipe: the caller names the parameter in an error.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from onnx import helper, numpy_helper

MAX_PERMUTE_RANK = 4  # all permutations up to this rank (24); beyond it only identity and reversal


@dataclass(frozen=True)
class Step:
    """One ONNX node of a recipe: ``op(x, *inputs)`` with constant extra inputs (numpy arrays)."""

    op: str
    inputs: tuple[np.ndarray, ...] = ()
    attrs: tuple[tuple[str, Any], ...] = ()  # ONNX attributes (ints, lists)


@dataclass(frozen=True)
class Recipe:
    """How a constant is computed from one parameter: the steps, in order, from the parameter."""

    kind: str  # "select" | "unary" | "reduce"
    steps: tuple[Step, ...]
    text: str  # what it is, for messages ("rows 0..7 along axis 0", "Exp", ...)
    gathers: tuple[int, ...] = field(default=())  # the rows looked up, for "select" by rows

    def apply(self, value: np.ndarray) -> np.ndarray:
        """The recipe run on ``value`` with numpy (the check that it gives the constant)."""
        for step in self.steps:
            value = _run(step, value)
        return value


class Ambiguous(Exception):
    """More than one recipe gives the constant (repeated rows, a tensor of one repeated value)."""


def _i64(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def _run(step: Step, x: np.ndarray) -> np.ndarray:
    attrs = dict(step.attrs)
    if step.op == "Transpose":
        return np.transpose(x, attrs["perm"])
    if step.op == "Reshape":
        return x.reshape(step.inputs[0])
    if step.op == "Expand":
        return np.broadcast_to(x, tuple(step.inputs[0]))
    if step.op == "Gather":
        return np.take(x, step.inputs[0], axis=0)
    if step.op in ("ReduceSum", "ReduceMean"):
        fn = np.sum if step.op == "ReduceSum" else np.mean
        return fn(x, axis=tuple(int(a) for a in step.inputs[0]), keepdims=bool(attrs["keepdims"])).astype(x.dtype)
    if step.op == "Mul":
        return (x * step.inputs[0]).astype(x.dtype)
    if step.op == "Add":
        return (x + step.inputs[0]).astype(x.dtype)
    return UNARY[step.op][0](x).astype(x.dtype)


def _softplus(x):
    return np.logaddexp(0, x)


# ONNX op -> (numpy function, its inverse)
UNARY: dict[str, tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray]]] = {
    "Exp": (np.exp, np.log),
    "Log": (np.log, np.exp),
    "Neg": (np.negative, np.negative),
    "Reciprocal": (np.reciprocal, np.reciprocal),
    "Sqrt": (np.sqrt, np.square),
    "Sigmoid": (lambda x: 1 / (1 + np.exp(-x)), lambda y: np.log(y / (1 - y))),
    "Tanh": (np.tanh, np.arctanh),
    "Softplus": (_softplus, lambda y: np.log(np.expm1(y))),
}
# the fx node names of torch's ops (``exp``, ``exp_1``) -> the ONNX op that inverts to them
FX_UNARY = {"exp": "Exp", "log": "Log", "neg": "Neg", "reciprocal": "Reciprocal", "sqrt": "Sqrt",
            "sigmoid": "Sigmoid", "tanh": "Tanh", "softplus": "Softplus"}


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape or not np.all(np.isfinite(a)):
        return False
    scale = float(np.abs(b).max(initial=0.0))
    return bool(np.allclose(a, b, rtol=1e-5, atol=1e-6 * scale + 1e-30))


def _permutations(rank: int):
    if rank <= MAX_PERMUTE_RANK:
        return list(itertools.permutations(range(rank)))
    return [tuple(range(rank)), tuple(reversed(range(rank)))]


def _reshape_steps(shape, target) -> tuple[Step, ...]:
    return () if tuple(shape) == tuple(target) else (Step("Reshape", (_i64(target),)),)


def _permuted(c: np.ndarray, p: np.ndarray) -> list[Recipe]:
    """``c`` is ``p`` transposed by some permutation and reshaped."""
    out: list[Recipe] = []
    if c.size != p.size:
        return out
    for perm in _permutations(p.ndim):
        moved = np.transpose(p, perm)
        if np.array_equal(moved.flat[:16], c.flat[:16]) and np.array_equal(moved.reshape(c.shape), c):
            steps: tuple[Step, ...] = (() if perm == tuple(range(p.ndim))
                                       else (Step("Transpose", attrs=(("perm", list(perm)),)),))
            steps += _reshape_steps(moved.shape, c.shape)
            out.append(Recipe("select", steps, "the same values" if not steps else
                              f"transposed {list(perm)}" if perm != tuple(range(p.ndim)) else "reshaped"))
    return out


def _placements(dims: list[int], shape: tuple[int, ...]):
    """Ways to place ``dims`` (in order) at increasing positions of ``shape`` with equal sizes."""
    for positions in itertools.combinations(range(len(shape)), len(dims)):
        if all(shape[i] == d for i, d in zip(positions, dims)):
            yield positions


def _broadcast(c: np.ndarray, p: np.ndarray) -> list[Recipe]:
    """``c`` is ``p`` (its unit dims dropped) broadcast to ``c``'s shape."""
    dims = [d for d in p.shape if d != 1]
    if c.size <= p.size or len(dims) > c.ndim:
        return []
    squeezed = p.reshape(dims)
    for positions in _placements(dims, c.shape):
        shape = [1] * c.ndim
        for i, d in zip(positions, dims):
            shape[i] = d
        if np.array_equal(np.broadcast_to(squeezed.reshape(shape), c.shape), c):
            steps = _reshape_steps(p.shape, shape) + (Step("Expand", (_i64(c.shape),)),)
            return [Recipe("select", steps, f"broadcast to {list(c.shape)}")]
    return []


def _rows(c: np.ndarray, p: np.ndarray) -> list[Recipe]:
    """``c`` holds rows of ``p`` (slices along its first axis): ``Gather(p, ids)`` reshaped to ``c``;
    a row of a 2-D table may lie along any axis of ``c`` (then transposed into place)."""
    if p.ndim < 1 or c.ndim < 1:
        return []
    row = int(np.prod(p.shape[1:], dtype=np.int64))
    if p.ndim == 1:
        axes = [c.ndim - 1]
    elif p.ndim == 2:
        axes = [a for a in [c.ndim - 1, *range(c.ndim - 1)] if c.shape[a] == row]
    else:
        axes = [c.ndim - 1] if c.shape[c.ndim - (p.ndim - 1):] == p.shape[1:] else []
    if not axes:
        return []
    table = np.ascontiguousarray(p.reshape(p.shape[0], row))
    head = min(row, 8)  # rows indexed by their first elements, then compared whole
    index: dict[bytes, list[int]] = {}
    for i, r in enumerate(table[:, :head]):
        index.setdefault(r.tobytes(), []).append(i)
    for axis in axes:
        moved = np.moveaxis(c, axis, -1) if p.ndim == 2 else c
        rows = np.ascontiguousarray(moved).reshape(-1, row)
        ids: list[int] = []
        for r in rows:
            found = [i for i in index.get(r[:head].tobytes(), ()) if np.array_equal(table[i], r)]
            if len(found) > 1:
                raise Ambiguous(f"row {found[0]} of the parameter, which it looks up, repeats in the parameter "
                                f"(row {found[1]})")
            if not found:
                break
            ids.append(found[0])
        if len(ids) != len(rows):
            continue
        steps = (Step("Gather", (_i64(ids),)),) + _reshape_steps((len(ids), *p.shape[1:]), moved.shape)
        if moved.shape != c.shape:
            perm = list(range(c.ndim - 1))
            perm.insert(axis, c.ndim - 1)
            steps += (Step("Transpose", attrs=(("perm", perm),)),)
        unique = sorted(set(ids))
        text = (f"rows {unique[0]}..{unique[-1]}" if unique == list(range(unique[0], unique[-1] + 1))
                else f"{len(unique)} of its rows") + " looked up with constant ids"
        return [Recipe("select", steps, text, tuple(unique))]
    return []


def _reductions(p: np.ndarray):
    for k in range(1, p.ndim + 1):
        for axes in itertools.combinations(range(p.ndim), k):
            for keepdims in (0, 1):
                for op in ("ReduceSum", "ReduceMean"):
                    yield Step(op, (_i64(axes),), (("keepdims", keepdims),))


def _reduced_shape(shape: tuple[int, ...], axes: tuple[int, ...], keepdims: int) -> tuple[int, ...]:
    return tuple(1 if i in axes else d for i, d in enumerate(shape)) if keepdims else \
        tuple(d for i, d in enumerate(shape) if i not in axes)


def _arithmetic(c: np.ndarray, p: np.ndarray) -> list[Recipe]:
    """``c = a * f(p) + b``: ``f`` one elementwise function, a reduction, or none, then scalars."""
    bases: list[tuple[str, tuple[Step, ...]]] = []
    if p.ndim <= MAX_PERMUTE_RANK:
        for step in _reductions(p):
            axes, keepdims = tuple(int(a) for a in step.inputs[0]), dict(step.attrs)["keepdims"]
            if _reduced_shape(p.shape, axes, keepdims) == c.shape:
                bases.append(("reduce", (step,)))
    if p.shape == c.shape:
        bases += [("unary", (Step(op),)) for op in UNARY] + [("unary", ())]
    out = []
    with np.errstate(all="ignore"):
        for kind, steps in bases:
            base = p.astype(np.float64)
            for step in steps:
                base = _run(step, base)
            if _close(base.astype(c.dtype), c):
                if steps:
                    out.append(Recipe(kind, steps, steps[0].op))
                continue
            fit = _affine(base, c)
            if fit is not None:
                a, b = fit
                tail = tuple(s for s, keep in ((Step("Mul", (np.asarray(a, c.dtype),)), a != 1),
                                                (Step("Add", (np.asarray(b, c.dtype),)), b != 0)) if keep)
                words = [s.op for s in steps] + ([f"* {a:.6g}"] if a != 1 else []) + ([f"+ {b:.6g}"] if b else [])
                out.append(Recipe(kind, steps + tail, " then ".join(words)))
    return out


def _affine(base: np.ndarray, c: np.ndarray) -> tuple[float, float] | None:
    """Scalars ``a != 0, b`` with ``a * base + b == c`` (to float32 rounding), fitted on the two
    elements of most distant base values; short decimals (``0.1``) when they fit as well."""
    flat, target = base.ravel(), c.ravel().astype(np.float64)
    if flat.size < 2 or not np.all(np.isfinite(flat)):
        return None
    i, j = int(np.argmin(flat)), int(np.argmax(flat))
    if flat[j] - flat[i] <= 1e-9 * max(abs(flat[j]), abs(flat[i]), 1e-30):
        return None
    a = (target[j] - target[i]) / (flat[j] - flat[i])
    b = target[i] - a * flat[i]
    for fa, fb in ((float(f"{a:.6g}"), float(f"{b:.6g}")), (a, b)):
        if fa != 0 and _close((fa * base + fb).astype(c.dtype), c):
            return fa, (0.0 if abs(fb) <= 1e-7 * float(np.abs(target).max(initial=0)) else fb)
    return None


def _distinct(recipes: list[Recipe], p: np.ndarray) -> list[Recipe]:
    """The recipes that compute different functions of the parameter (told apart on a random
    tensor near it; equal ones, ``ReduceMean * n`` and ``ReduceSum``, count once)."""
    g = np.random.default_rng(0)
    probe = (p.astype(np.float64) * (1 + 0.1 * g.standard_normal(p.shape)) + 0.01 * g.standard_normal(p.shape))
    probe = np.abs(probe) if np.all(p > 0) else probe  # Log, Sqrt keep their domain
    out: list[tuple[Recipe, np.ndarray]] = []
    with np.errstate(all="ignore"):
        for r in recipes:
            value = r.apply(probe.astype(p.dtype)).astype(np.float64)
            if not any(v.shape == value.shape and np.allclose(v, value, rtol=1e-4, atol=1e-6, equal_nan=True)
                       for _, v in out):
                out.append((r, value))
    return [r for r, _ in out]


def find_recipe(c: np.ndarray, p: np.ndarray) -> Recipe | None:
    """How ``c`` was computed from ``p`` (see the module doc), or None.

    Raises:
        Ambiguous: computations that differ give ``c`` (the parameter's values repeat, or are
            all one value), so which elements' gradients the constant carries cannot be told.
    """
    if c.dtype != p.dtype or not np.issubdtype(c.dtype, np.floating) or p.size == 0:
        return None
    found = _permuted(c, p) or _broadcast(c, p) or _rows(c, p) or _arithmetic(c, p)
    if not found:
        return None
    if p.size > 1 and np.all(p == p.flat[0]):
        raise Ambiguous(f"all its values are equal ({p.flat[0]:g})")
    if len(found) == 1:
        return found[0]
    distinct = _distinct(sorted(found, key=lambda r: len(r.steps)), p)  # the simplest of equal ones
    if len(distinct) > 1:
        raise Ambiguous(" and ".join(r.text for r in distinct[:3]) + " all give the constant")
    return distinct[0]


def invert(c: np.ndarray, fx_name: str) -> tuple[np.ndarray, Recipe] | None:
    """The parameter's value from a constant that one torch op computed from it alone, told by
    the fx node name the constant carries (``exp``, ``t``...): ``(value, recipe from it)``."""
    op = fx_name.rstrip("0123456789").rstrip("_")
    if op in FX_UNARY and np.issubdtype(c.dtype, np.floating):
        with np.errstate(all="ignore"):
            value = UNARY[FX_UNARY[op]][1](c.astype(np.float64)).astype(c.dtype)
        recipe = Recipe("unary", (Step(FX_UNARY[op]),), FX_UNARY[op])
        return (value, recipe) if np.all(np.isfinite(value)) and _close(recipe.apply(value), c) else None
    if op in ("t", "numpy_T") and c.ndim == 2:
        return np.ascontiguousarray(c.T), Recipe("select", (Step("Transpose", attrs=(("perm", [1, 0]),)),),
                                                 "transposed [1, 0]")
    return None


def emit(recipe: Recipe, source: str, output: str, fresh) -> tuple[list, list]:
    """ONNX nodes computing ``output`` from the tensor named ``source`` by ``recipe``, and the
    initializers they read. ``fresh(base)`` gives unused names."""
    nodes, inits = [], []
    x = source
    for k, step in enumerate(recipe.steps):
        y = output if k == len(recipe.steps) - 1 else fresh(f"{output}__{step.op.lower()}")
        names = []
        for j, value in enumerate(step.inputs):
            name = fresh(f"{output}__{step.op.lower()}_in{j}")
            inits.append(numpy_helper.from_array(np.asarray(value, order="C"), name))
            names.append(name)
        nodes.append(helper.make_node(step.op, [x, *names], [y], name=fresh(f"{output}__{step.op}"),
                                      **dict(step.attrs)))
        x = y
    if not recipe.steps:
        nodes.append(helper.make_node("Identity", [source], [output], name=fresh(f"{output}__Identity")))
    return nodes, inits
