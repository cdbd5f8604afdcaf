"""Node emission for derivative graphs: fresh names, constants, and the shape helpers rules share.

An :class:`Emitter` collects the ordinary ONNX nodes one Gradient expansion produces.
Every name it creates starts with its prefix (``<gradient node>/grad/``), so names stay
unique. It knows the static type/shape facts of existing values (:class:`ValueMeta`, from
shape inference) and emits static constants when those facts suffice, ``Shape``-based
subgraphs otherwise, so the emitted graph also runs when dimensions are dynamic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .native_ops import DOMAIN as NATIVE_DOMAIN

Dim = int | str | None
Shape = tuple | None  # tuple[Dim, ...] or None when the rank is unknown

FLOAT_TYPES = frozenset(
    {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16}
)


@dataclass(frozen=True)
class ValueMeta:
    """What shape inference knows about one value: element type and dims (None = unknown)."""

    dtype: int | None = None
    shape: Shape = None

    @staticmethod
    def from_type(tp: onnx.TypeProto) -> ValueMeta:
        if not tp.HasField("tensor_type"):
            return ValueMeta()
        tt = tp.tensor_type
        dtype = tt.elem_type or None
        if not tt.HasField("shape"):
            return ValueMeta(dtype, None)
        dims: list[Dim] = []
        for d in tt.shape.dim:
            if d.HasField("dim_value"):
                dims.append(int(d.dim_value))
            elif d.HasField("dim_param") and d.dim_param:
                dims.append(d.dim_param)
            else:
                dims.append(None)
        return ValueMeta(dtype, tuple(dims))


def static_dims(shape: Shape) -> tuple[int, ...] | None:
    """The shape as ints when every dim is known, else None."""
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    return tuple(shape)


class Emitter:
    """Builds the node list of one expansion.

    ``meta`` maps value names to :class:`ValueMeta`; ``opset`` is the default-domain opset
    of the graph, which decides the form of ops whose signature changed (ReduceSum,
    Squeeze/Unsqueeze, Split, Pad...). ``native``: the native backward ops
    (:mod:`.native_ops`) rules may emit; empty for the standard-op forms.
    """

    def __init__(self, prefix: str, opset: int, meta: dict[str, ValueMeta],
                 native: frozenset = frozenset()):
        self.prefix = prefix
        self.opset = opset
        self.meta = meta
        self.native = native
        self.nodes: list[onnx.NodeProto] = []
        self._count = 0
        self._const_cache: dict[tuple, str] = {}
        self._shape_cache: dict[str, str] = {}

    # ----------------------------------------------------------------- naming / nodes
    def fresh(self, hint: str) -> str:
        self._count += 1
        return f"{self.prefix}{hint}_{self._count}"

    def op(self, op_type: str, inputs: Sequence[str], hint: str | None = None,
           **attrs) -> str:
        """Emit one single-output node; return its output name."""
        return self.op_n(op_type, inputs, 1, hint, **attrs)[0]

    def op_n(self, op_type: str, inputs: Sequence[str], n_out: int, hint: str | None = None,
             **attrs) -> list[str]:
        outs = [self.fresh(hint or op_type) for _ in range(n_out)]
        attrs = {k: v for k, v in attrs.items() if v is not None}
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=outs[0], **attrs))
        return outs

    def native_op(self, op_type: str, inputs: Sequence[str], hint: str | None = None, doc: str = "") -> str:
        """One node of a native backward op (:mod:`.native_ops`); the caller checked
        ``op_type in self.native``. ``doc``: the node's doc_string (what a later pass reads)."""
        out = self.fresh(hint or op_type)
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, domain=NATIVE_DOMAIN,
                                           doc_string=doc or None))
        return out

    def add_node(self, node: onnx.NodeProto) -> None:
        self.nodes.append(node)

    def check(self, ok: str, value: str, message: str) -> str:
        """``value`` times a one that onnxruntime computes only when the bool ``ok`` (one element)
        holds: otherwise a Reshape of that one element to two, named ``message``, fails the run
        (for a condition the graph cannot decide before it runs). Pass a small value the result
        depends on, a scale: the check then costs nothing, and no optimizer can drop it as a
        no-op the way it drops a Reshape to the same shape."""
        target = self.op("Where", [ok, self.ints([1]), self.ints([2])], "check")
        one = self.fresh("one")
        self.nodes.append(helper.make_node("Reshape", [self.scalar(1.0, value), target], [one],
                                           name=self.fresh(message)))
        return self.op("Mul", [value, one], "checked")

    # ----------------------------------------------------------------- facts
    def info(self, name: str) -> ValueMeta:
        return self.meta.get(name, ValueMeta())

    def dtype(self, name: str) -> int | None:
        return self.info(name).dtype

    def shape(self, name: str) -> Shape:
        return self.info(name).shape

    def known_dtype(self, name: str) -> int:
        """The element type of ``name``; a LookupError (the walk names the node) when inference found none."""
        dt = self.dtype(name)
        if dt is None:
            raise LookupError(f"element type of {name!r} unknown (shape inference found none)")
        return dt

    def known_shape(self, name: str) -> tuple:
        """The shape of ``name`` (dims: ints or symbols); a LookupError when its rank is unknown."""
        s = self.shape(name)
        if s is None:
            raise LookupError(f"the rank of {name!r} is unknown (shape inference found none)")
        return s

    def rank(self, name: str) -> int | None:
        s = self.shape(name)
        return None if s is None else len(s)

    def set_meta(self, name: str, dtype: int | None, shape: Shape) -> None:
        self.meta[name] = ValueMeta(dtype, shape)

    # ----------------------------------------------------------------- constants
    def const(self, array: np.ndarray, hint: str = "const") -> str:
        array = np.asarray(array)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._const_cache:
            name = self.fresh(hint)
            tensor = numpy_helper.from_array(array, name)
            self.nodes.append(helper.make_node("Constant", [], [name], name=name, value=tensor))
            self.meta[name] = ValueMeta(
                helper.np_dtype_to_tensor_dtype(array.dtype), tuple(array.shape))
            self._const_cache[key] = name
        return self._const_cache[key]

    def ints(self, values: Sequence[int]) -> str:
        """A 1-D int64 constant."""
        return self.const(np.asarray(list(values), dtype=np.int64), "ints")

    def scalar(self, value: float, like: str) -> str:
        """A scalar constant with the element type of ``like``."""
        dt = self.dtype(like)
        if dt is not None:
            return self.const(np.asarray(value, dtype=helper.tensor_dtype_to_np_dtype(dt)))
        return self.cast_like(self.const(np.asarray(value, dtype=np.float32)), like)

    def cast_like(self, x: str, like: str) -> str:
        """``x`` converted to the element type of ``like`` (skipped when already equal)."""
        dt = self.dtype(like)
        if dt is not None:
            if self.dtype(x) == dt:
                return x
            return self.op("Cast", [x], "cast", to=dt)
        if self.opset >= 15:
            return self.op("CastLike", [x, like], "cast")
        raise LookupError(f"element type of {like!r} unknown (and opset {self.opset} < 15 "
                          "has no CastLike)")

    def filled_like(self, value: float, like: str) -> str:
        """A tensor with the shape and element type of ``like``, every element ``value``."""
        s = static_dims(self.shape(like))
        dt = self.dtype(like)
        if s is not None and dt is not None and int(np.prod(s, dtype=np.int64)) <= 1:
            return self.const(np.full(s, value, dtype=helper.tensor_dtype_to_np_dtype(dt)))
        if dt is not None:
            return self.op("ConstantOfShape", [self.shape_of(like)], "fill",
                           value=numpy_helper.from_array(
                               np.asarray([value], dtype=helper.tensor_dtype_to_np_dtype(dt))))
        return self.op("Expand", [self.scalar(value, like), self.shape_of(like)], "fill")

    # ----------------------------------------------------------------- shape helpers
    def shape_of(self, name: str) -> str:
        """A 1-D int64 tensor holding the runtime shape of ``name`` (static if known)."""
        s = static_dims(self.shape(name))
        if s is not None:
            return self.ints(s)
        if name not in self._shape_cache:
            self._shape_cache[name] = self.op("Shape", [name], "shape")
        return self._shape_cache[name]

    def dims_of(self, name: str, start: int, end: int | None = None) -> str:
        """``Shape(name)[start:end]`` as a 1-D int64 tensor (static if known)."""
        s = self.shape(name)
        if s is not None:
            part = s[start:end]
            if all(isinstance(d, int) for d in part):
                return self.ints(part)
        full = self.shape_of(name)
        ends = [end if end is not None else np.iinfo(np.int64).max]
        return self.op("Slice", [full, self.ints([start]), self.ints(ends)], "dims")

    def flat_rows(self, name: str, axis: int) -> str:
        """``[-1, Shape(name)[axis]]``: the target that reshapes a tensor into rows as long
        as that dim of ``name`` (static when known)."""
        dims = self.shape(name)
        if dims is not None and isinstance(dims[axis], int):
            return self.ints([-1, dims[axis]])
        return self.op("Concat", [self.ints([-1]), self.dims_of(name, axis, axis + 1)], "rows", axis=0)

    def reduce_sum(self, x: str, axes: Sequence[int] | str, keepdims: bool) -> str:
        """ReduceSum over ``axes`` (a static list, or a 1-D int64 tensor name for opset >= 13)."""
        if self.opset >= 13:
            ax = axes if isinstance(axes, str) else self.ints(axes)
            return self.op("ReduceSum", [x, ax], "rsum", keepdims=int(keepdims))
        if isinstance(axes, str):
            raise LookupError(f"opset {self.opset} ReduceSum needs static axes")
        return self.op("ReduceSum", [x], "rsum", axes=list(axes), keepdims=int(keepdims))

    def squeeze(self, x: str, axes: Sequence[int]) -> str:
        if self.opset >= 13:
            return self.op("Squeeze", [x, self.ints(axes)], "squeeze")
        return self.op("Squeeze", [x], "squeeze", axes=list(axes))

    def unsqueeze(self, x: str, axes: Sequence[int] | str) -> str:
        if self.opset >= 13:
            ax = axes if isinstance(axes, str) else self.ints(axes)
            return self.op("Unsqueeze", [x, ax], "unsqueeze")
        if isinstance(axes, str):
            raise LookupError(f"opset {self.opset} Unsqueeze needs static axes")
        return self.op("Unsqueeze", [x], "unsqueeze", axes=list(axes))

    def reshape_like(self, x: str, like: str) -> str:
        return self.op("Reshape", [x, self.shape_of(like)], "reshape")

    def swap_last_two(self, x: str, rank: int) -> str:
        perm = list(range(rank - 2)) + [rank - 1, rank - 2]
        return self.op("Transpose", [x], "transpose", perm=perm)

    def unbroadcast(self, g: str, g_shape: Shape, target: str,
                    target_shape: Shape | str = "meta") -> str:
        """Sum ``g`` (shaped like a numpy-broadcast result) back to the shape of ``target``.

        Static axes are used when the shapes decide them; otherwise the axes are computed at
        run time: ``NonZero(Shape(target) padded with 1s != Shape(g))`` then
        ``ReduceSum(keepdims=1, noop_with_empty_axes=1)`` and ``Reshape``.
        """
        ts = self.shape(target) if target_shape == "meta" else target_shape
        gs = g_shape
        if ts is not None and gs is not None and len(gs) >= len(ts):
            lead = len(gs) - len(ts)
            axes = list(range(lead))
            decided = True
            for i, d in enumerate(ts):
                od = gs[lead + i]
                if d == 1:
                    if od != 1:
                        axes.append(lead + i)
                elif isinstance(d, int) or (d is not None and d == od):
                    continue
                else:
                    decided = False
                    break
            if decided:
                if not axes:
                    return g
                if axes == list(range(lead)):  # leading axes only: one node
                    return self.reduce_sum(g, axes, keepdims=False)
                r = self.reduce_sum(g, axes, keepdims=True)
                return self.squeeze(r, list(range(lead))) if lead else r
        if self.opset < 13:
            raise LookupError(f"broadcast reduction with unknown shapes needs opset >= 13 "
                              f"(graph has {self.opset})")
        g_dims = self.op("Shape", [g], "shape")
        t_dims = self.shape_of(target)
        if ts is not None and gs is not None:
            pad = len(gs) - len(ts)
            padded = t_dims if pad <= 0 else self.op(
                "Concat", [self.ints([1] * pad), t_dims], "dims", axis=0)
        else:
            missing = self.op("Sub", [self.op("Size", [g_dims]), self.op("Size", [t_dims])])
            ones = self.op("ConstantOfShape", [self.unsqueeze(missing, [0])], "ones",
                           value=numpy_helper.from_array(np.asarray([1], dtype=np.int64)))
            padded = self.op("Concat", [ones, t_dims], "dims", axis=0)
        differ = self.op("Not", [self.op("Equal", [padded, g_dims])])
        axes_t = self.op("Reshape", [self.op("NonZero", [differ]), self.ints([-1])], "axes")
        r = self.op("ReduceSum", [g, axes_t], "rsum", keepdims=1, noop_with_empty_axes=1)
        return self.op("Reshape", [r, t_dims], "reshape")
