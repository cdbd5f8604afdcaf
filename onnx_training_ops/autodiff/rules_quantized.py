"""onnxruntime's block-quantized ops (``com.microsoft``): MatMulNBits and GatherBlockQuantized.

The quantized weight is frozen: its packed data, scales, zero points and ``g_idx`` never train
(a LoRA adapter beside the node does). ``MatMulNBits`` computes ``Y = A · dequant(B)ᵀ (+ bias)``
with ``dequant(B)`` the ``[N, K]`` matrix ``(q - zero_point) * scale``, blocks of
``block_size`` along K; the input's gradient is

    dA = dY · dequant(B)

a ``MatMul`` on the dequantized ``[N, K]`` weight, made in the backward pass just before that
``MatMul`` needs it and freed after it, never the whole model in float (a 7B base at int4 holds
3.5 GB of packed weights; in float32 it would be 28 GB). A weight past
:data:`DEQUANTIZED_BYTES` in float32 goes by row ranges of at most that size, each dequantized
just before its product and summed into the last one's ``Gemm`` (``C``, ``beta=1``)::

    dA = dY[:, r0:r1] · dequant(B)[r0:r1] + ( ... + dY[:, 0:r] · dequant(B)[0:r])

so one range is held in float at a time (16 MB: an LLM's ``lm_head`` is 262 MB), written and read
back while still in the CPU's cache (on a GPU, :data:`DEQUANTIZED_BYTES_GPU`: fewer, larger
ranges). The dequantization is one ``GatherBlockQuantized`` of the
range's rows (onnxruntime has it on the CPU and CUDA EPs; 2, 4 and 8 bits, uint8 zero points),
on the native path the native ``TrainingDequantizeRows`` (the same values, in a quarter of the
time: :mod:`onnx_training_ops.kernels._native_dequant_kernels`); ``g_idx`` and float zero points
take a standard-op form of all rows. Each reads an index
computed from ``dY`` (or from the previous range's sum): no optimizer can take the
dequantization for a constant of the session (folded, every layer's float weight would stay for
the session's life), and it runs after ``dY`` exists, next to its product (measured on one
Llama-2-7B-shaped layer: not tied to ``dY``, the step's peak RSS was 410 MB higher).

With ``accuracy_level=4`` (the genai builder's CPU default) the forward quantizes ``A`` to
int8 inside the kernel; the gradient above is then straight-through: that rounding is treated
as the identity, as quantization-aware training does (``docs/gradient.md``).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from .emitter import Emitter
from .native_ops import DEQUANTIZE_ROWS, GPU_RANGES
from .registry import RuleContext, RuleError, register

MS = "com.microsoft"
# float32 bytes of one dequantized row range on the CPU. Measured (int4 LoRA step, 2 cores, interleaved
# steps): Llama-2-7B's shape, 2 layers, 4 / 8 / 16 / 32 MB: 4.75 / 3.96 / 3.50-3.81 / 3.48 s a step
# (GEMMs of a few hundred rows lose efficiency); TinyLlama's, 2 layers: 1.09 / 1.15 / 1.06 / 1.05 s
DEQUANTIZED_BYTES = 16 << 20
DEQUANTIZED_BYTES_GPU = 32 << 20  # on a GPU (the expansion allows GPU_RANGES): memory, not cache


def row_ranges(n: int, k: int, limit: int | None = None) -> list[tuple[int, int]]:
    """``[0, n)`` cut into equal row ranges whose ``[rows, k]`` float32 weight is at most
    ``limit`` bytes (default :data:`DEQUANTIZED_BYTES`; one range at least one row)."""
    limit = DEQUANTIZED_BYTES if limit is None else limit
    count = -(-n // max(1, limit // (k * 4)))  # ranges of at most that many rows, then evened out
    rows = -(-n // count)
    return [(start, min(start + rows, n)) for start in range(0, n, rows)]


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
        self._tables: list[str] | None = None
        if self.g_idx is not None and (self.bits != 4 or (self.zero_points is not None and not self.zp_float)):
            # measured with onnxruntime 1.32: its CPU kernel then dequantizes with zero point 8 (uint8 zero
            # points) or mis-indexes (2 bits), so no gradient matches both the kernel and the op's definition
            raise RuleError("g_idx is differentiated with 4 bits and float or no zero points only (where "
                            "onnxruntime's kernel computes the op as specified)")

    @property
    def by_rows(self) -> bool:
        """Whether :meth:`dequantized` takes a row range (the ``GatherBlockQuantized`` form)."""
        return self.g_idx is None and not self.zp_float

    def dequantized(self, gate: str, like: str, rows: tuple[int, int] | None = None) -> str:
        """``dequant(B)`` as ``[N, K]`` (its ``rows`` range where given: :attr:`by_rows` only),
        of the element type of ``like``, computed once ``gate`` is."""
        em = self.ctx.em
        start, stop = rows or (0, self.n)
        if self.by_rows:
            w = self._gather_block_quantized(gate, start, stop)
        elif rows is None:
            w = self._standard_ops(gate)
        else:
            raise RuleError("a row range of a weight with g_idx or float zero points")
        em.set_meta(w, em.dtype(self.scales), (stop - start, self.k))
        return em.cast_like(w, like)

    def _gather_block_quantized(self, gate: str, start: int, stop: int) -> str:
        em = self.ctx.em
        width = self.blocks * self.block
        if DEQUANTIZE_ROWS in em.native and em.dtype(self.scales) == TensorProto.FLOAT:
            # ``gate`` as an input it does not read: run after it, never folded
            config = em.const(np.asarray([self.bits, self.block, self.k, start, stop], np.int64), "config")
            zero_points = self.zero_points or em.const(np.zeros(0, np.uint8), "no_zero_points")
            return em.native_op(DEQUANTIZE_ROWS, [self.packed, self.scales, zero_points, config, gate], "dequant")
        zero = _runtime_zero(em, gate)
        rows = _gated(em, em.const(np.arange(start, stop, dtype=np.int64), "rows"), zero)
        w = em.op("GatherBlockQuantized", self._table(rows), "dequant", domain=MS, bits=self.bits,
                  block_size=self.block, gather_axis=0, quantize_axis=1)
        if width != self.k:
            w = em.op("Slice", [w, em.ints([0]), em.ints([self.k]), em.ints([1])], "dequant")
        return w

    def _table(self, rows: str) -> list[str]:
        """``GatherBlockQuantized``'s inputs for ``rows``: B, scales and zero points as ``[N, ...]``
        tables, reshaped once per weight (onnxruntime folds a Reshape of a constant into a copy
        kept for the session's life: one, not one per row range)."""
        if self._tables is None:
            em = self.ctx.em

            def reshaped(x: str, shape: list[int], hint: str) -> str:  # as it is where it has that shape
                return x if em.shape(x) == tuple(shape) else em.op("Reshape", [x, em.ints(shape)], hint)

            width = self.blocks * self.block
            self._tables = [reshaped(self.packed, [self.n, width * self.bits // 8], "packed"),
                            reshaped(self.scales, [self.n, self.blocks], "scales")]
            if self.zero_points is not None:
                zp_bytes = -(-self.blocks * self.bits // 8)
                self._tables.append(reshaped(self.zero_points, [self.n, zp_bytes], "zero_points"))
        data, scales, *zero_points = self._tables
        return [data, rows, scales, *zero_points]

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
    em, g = ctx.em, ctx.dy
    if any(ctx.need(i) for i in (1, 2, 3, 4)):
        raise RuleError("the quantized weight (B, scales, zero_points, g_idx) is frozen")
    out = ctx.empty()
    weight = QuantizedWeight(ctx)
    if ctx.need(0):
        a = ctx.node.input[0]
        limit = DEQUANTIZED_BYTES_GPU if GPU_RANGES in em.native else DEQUANTIZED_BYTES
        ranges = row_ranges(weight.n, weight.k, limit) if weight.by_rows else [(0, weight.n)]
        if len(ranges) == 1:
            out[0] = em.op("MatMul", [g, weight.dequantized(g, a)], "input_grad")
        else:
            out[0] = _input_grad_by_rows(em, g, weight, a, ranges)
    if ctx.need(5):
        rows = em.op("Reshape", [g, em.ints([-1, weight.n])], "rows")
        out[5] = em.reduce_sum(rows, [0], keepdims=False)
    return out


def _input_grad_by_rows(em: Emitter, g: str, weight: QuantizedWeight, a: str, ranges: list[tuple[int, int]]) -> str:
    """``dY · dequant(B)`` summed over row ranges, each range's product a ``Gemm`` onto the
    sum so far: one range in float at a time, made once the previous sum exists."""
    rows = em.op("Reshape", [g, em.ints([-1, weight.n])], "rows")
    total = None
    for start, stop in ranges:
        part = em.op("Slice", [rows, em.ints([start]), em.ints([stop]), em.ints([1])], "part")
        w = weight.dequantized(total or rows, a, (start, stop))
        total = em.op("Gemm", [part, w], "partial") if total is None else \
            em.op("Gemm", [part, w, total], "partial", beta=1.0)
    assert total is not None
    return em.op("Reshape", [total, em.shape_of(a)], "input_grad")


@register(f"{MS}::GatherBlockQuantized", frozen=(0, 2, 3))
def _gather_block_quantized(ctx: RuleContext) -> list:
    """A lookup in a frozen quantized table (the genai builder's tied embedding): nothing trains."""
    if any(ctx.need(i) for i in range(len(ctx.node.input))):
        raise RuleError("the quantized table (data, scales, zero_points) is frozen")
    return ctx.empty()
