"""onnxruntime's block-quantized ops (``com.microsoft``): MatMulNBits and GatherBlockQuantized.

The quantized weight is frozen: its packed data, scales, zero points and ``g_idx`` never train
(a LoRA adapter beside the node does). ``MatMulNBits`` computes ``Y = A · dequant(B)ᵀ (+ bias)``
with ``dequant(B)`` the ``[N, K]`` matrix ``(q - zero_point) * scale``, blocks of
``block_size`` along K; the input's gradient is

    dA = dY · dequant(B)

a plain ``MatMul`` on the dequantized ``[N, K]`` weight, made in the backward pass just before
that ``MatMul`` needs it and freed after it: one layer's weight in float at a time, never the
whole model (a 7B base at int4 holds 3.5 GB of packed weights; in float32 it would be 28 GB).
The dequantization is one ``GatherBlockQuantized`` over all N rows (onnxruntime has it on the
CPU and CUDA EPs; 2, 4 and 8 bits, uint8 zero points); ``g_idx`` and float zero points take a
standard-op form. Both read an index computed from ``dY``'s first element: no optimizer can
take the dequantization for a constant of the session (folded, every layer's float weight would
stay for the session's life), and it runs after ``dY`` exists, next to its ``MatMul`` (measured
on one Llama-2-7B-shaped layer: not tied to ``dY``, the step's peak RSS was 410 MB higher).

With ``accuracy_level=4`` (the genai builder's CPU default) the forward quantizes ``A`` to
int8 inside the kernel; the gradient above is then straight-through: that rounding is treated
as the identity, as quantization-aware training does (``docs/gradient.md``).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from .emitter import Emitter
from .registry import RuleContext, RuleError, register

MS = "com.microsoft"


def _runtime_zero(em: Emitter, like: str) -> str:
    """An int64 ``[1]`` zero that onnxruntime can only know once ``like`` is computed (its
    first element compared with itself: false even for NaN)."""
    first = em.op("Slice", [em.op("Reshape", [like, em.ints([-1])], "flat"), em.ints([0]), em.ints([1])], "first")
    return em.op("Cast", [em.op("Less", [first, first], "never")], "zero", to=TensorProto.INT64)


def _gated(em: Emitter, indices: str, zero: str) -> str:
    """``indices`` (int64), available only once ``zero`` (:func:`_runtime_zero`) is."""
    return em.op("Add", [indices, zero], "gated")


def _unpack(em: Emitter, packed: str, bits: int, dtype: int) -> str:
    """uint8 ``[..., bytes]`` -> ``[..., bytes * 8 / bits]`` values in ``dtype``, low bits first."""
    per_byte = 8 // bits
    if per_byte == 1:
        return em.op("Cast", [packed], "values", to=dtype)
    b = em.op("Unsqueeze", [em.op("Cast", [packed], "bytes", to=dtype), em.ints([-1])], "bytes")
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    shifts = em.const(np.asarray([2.0 ** (bits * k) for k in range(per_byte)], dtype=np_dtype), "shifts")
    fields = em.op("Mod", [em.op("Floor", [em.op("Div", [b, shifts])]), em.const(np.asarray(2.0 ** bits, np_dtype))],
                   "fields", fmod=1)
    return em.op("Reshape", [fields, em.ints([0, -1])], "values")


class QuantizedWeight:
    """The frozen ``[N, K]`` weight of one MatMulNBits node."""

    def __init__(self, ctx: RuleContext):
        node = ctx.node
        self.ctx = ctx
        self.n, self.k = int(ctx.attr("N")), int(ctx.attr("K"))
        self.bits, self.block = int(ctx.attr("bits", 4)), int(ctx.attr("block_size"))
        if int(ctx.attr("weight_prepacked", 0)):
            raise RuleError("weight_prepacked != 0: B is in an execution provider's own layout")
        if self.bits not in (2, 4, 8):
            raise RuleError(f"bits={self.bits}: the dequantization handles 2, 4 and 8 bits")
        self.blocks = -(-self.k // self.block)
        self.packed, self.scales = node.input[1], node.input[2]
        self.zero_points, self.g_idx = ctx.input(3), ctx.input(4)
        self.zp_float = self.zero_points is not None and ctx.em.dtype(self.zero_points) not in (None, TensorProto.UINT8)
        if self.g_idx is not None and (self.bits != 4 or (self.zero_points is not None and not self.zp_float)):
            # measured with onnxruntime 1.32: its CPU kernel then dequantizes with zero point 8 (uint8 zero
            # points) or mis-indexes (2 bits), so no gradient matches both the kernel and the op's definition
            raise RuleError("g_idx is differentiated with 4 bits and float or no zero points only (where "
                            "onnxruntime's kernel computes the op as specified)")

    def dequantized(self, gate: str, like: str) -> str:
        """``dequant(B)`` as ``[N, K]``, of the element type of ``like``, computed once ``gate`` is."""
        em = self.ctx.em
        if self.g_idx is None and not self.zp_float:
            w = self._gather_block_quantized(gate)
        else:
            w = self._standard_ops(gate)
        em.set_meta(w, em.dtype(self.scales), (self.n, self.k))
        return em.cast_like(w, like)

    def _gather_block_quantized(self, gate: str) -> str:
        em = self.ctx.em
        width = self.blocks * self.block
        zero = _runtime_zero(em, gate)

        def reshaped(x: str, shape: list[int], hint: str) -> str:
            # read as it is where it has that shape (the genai builder's scales): onnxruntime folds a
            # Reshape of a constant into a copy, kept for the session's life
            return x if em.shape(x) == tuple(shape) else em.op("Reshape", [x, em.ints(shape)], hint)

        data = reshaped(self.packed, [self.n, width * self.bits // 8], "packed")
        scales = reshaped(self.scales, [self.n, self.blocks], "scales")
        rows = _gated(em, em.const(np.arange(self.n, dtype=np.int64), "rows"), zero)
        inputs = [data, rows, scales]
        if self.zero_points is not None:
            zp_bytes = -(-self.blocks * self.bits // 8)
            inputs.append(reshaped(self.zero_points, [self.n, zp_bytes], "zero_points"))
        w = em.op("GatherBlockQuantized", inputs, "dequant", domain=MS, bits=self.bits,
                  block_size=self.block, gather_axis=0, quantize_axis=1)
        if width != self.k:
            w = em.op("Slice", [w, em.ints([0]), em.ints([self.k]), em.ints([1])], "dequant")
        return w

    def _standard_ops(self, gate: str) -> str:
        """``(q - zp[:, block(k)]) * scale[:, block(k)]`` with ``block(k) = g_idx[k]`` (else
        ``k // block_size``), zero points float or none: for ``g_idx`` and float zero points,
        which GatherBlockQuantized does not take."""
        em = self.ctx.em
        dtype = em.dtype(self.scales) or TensorProto.FLOAT
        zero = _runtime_zero(em, gate)
        rows = _gated(em, em.const(np.arange(self.n, dtype=np.int64), "rows"), zero)
        packed = em.op("Reshape", [self.packed, em.ints([self.n, -1])], "packed")
        q = _unpack(em, em.op("Gather", [packed, rows], "packed", axis=0), self.bits, dtype)
        q = em.op("Slice", [q, em.ints([0]), em.ints([self.k]), em.ints([1])], "q")
        if self.g_idx is not None:
            block_of = em.op("Cast", [self.g_idx], "g_idx", to=TensorProto.INT64)
        else:
            block_of = em.const(np.arange(self.k, dtype=np.int64) // self.block, "block_of")
        block_of = _gated(em, block_of, zero)
        scales = em.op("Reshape", [self.scales, em.ints([self.n, self.blocks])], "scales")
        scale = em.op("Gather", [scales, block_of], "scale", axis=1)
        if self.zero_points is None:
            zp = em.const(np.asarray(2.0 ** (self.bits - 1), dtype=helper.tensor_dtype_to_np_dtype(dtype)))
        else:  # float zero points
            zp = em.op("Gather", [em.op("Reshape", [self.zero_points, em.ints([self.n, self.blocks])]), block_of],
                       "zero_point", axis=1)
        return em.op("Mul", [em.op("Sub", [q, zp]), scale], "dequant")


@register(f"{MS}::MatMulNBits", frozen=(1, 2, 3, 4))
def _matmul_nbits(ctx: RuleContext) -> list:
    """``dA = dY · dequant(B)``; ``dbias`` = dY summed over the rows. B, scales, zero points and
    ``g_idx`` are frozen."""
    em, g = ctx.em, ctx.grad(0)
    if any(ctx.need(i) for i in (1, 2, 3, 4)):
        raise RuleError("the quantized weight (B, scales, zero_points, g_idx) is frozen")
    out = ctx.empty()
    weight = QuantizedWeight(ctx)
    if ctx.need(0):
        a = ctx.node.input[0]
        out[0] = em.op("MatMul", [g, weight.dequantized(g, a)], "input_grad")
    if ctx.need(5):
        rows = em.op("Reshape", [g, em.ints([-1, weight.n])], "rows")
        out[5] = em.reduce_sum(rows, [0], keepdims=False)
    return out


@register(f"{MS}::GatherBlockQuantized", frozen=(0, 2, 3))
def _gather_block_quantized(ctx: RuleContext) -> list:
    """A lookup in a frozen quantized table (the genai builder's tied embedding): nothing trains."""
    if any(ctx.need(i) for i in range(len(ctx.node.input))):
        raise RuleError("the quantized table (data, scales, zero_points) is frozen")
    return ctx.empty()
