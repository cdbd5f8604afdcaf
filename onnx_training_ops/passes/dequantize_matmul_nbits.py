"""Pass: a float32 ``MatMulNBits`` whose weight is bound as an input becomes its dequantized
weight and one float GEMM, computing what the deployed (prepacked) kernel computes. CPU only.

onnxruntime's CPU ``MatMulNBits`` runs its quantized kernels only on a weight it prepacked at
load: a constant initializer. A training session binds a large model's frozen weights as inputs
instead (held once and read in place: :func:`~onnx_training_ops.training.graphs.binding.detached_as_inputs`),
and the kernel then falls back, on every call, to dequantizing the whole weight into a float32
``[N, K]`` buffer and a float GEMM, ignoring ``accuracy_level``. Two things go wrong (onnxruntime
1.32, 2 cores, ``A`` 256 x 2048):

* **Numerics.** At ``accuracy_level=4`` (the genai builder's CPU default) the deployed kernel
  quantizes ``A`` to int8 per block of ``block_size`` along K; the fallback does not. The two
  differ by 0.12 on outputs of magnitude 21: training would see another model than the one served.
* **Time.** The fallback takes 420 ms for a 32000 x 2048 ``lm_head`` where
  ``GatherBlockQuantized`` dequantizes the same weight in 30 ms and a float GEMM on it takes
  ~190 ms; for a 2048 -> 5632 projection, 60 ms against 5 + 33 ms.

So such a node becomes::

    A'  = round(A / s) * s,  s = max|A_block| / 127   per block of block_size along K, only where
                                                      the deployed kernel quantizes A (``int8_blocks``)
    W_r = dequant(B)[r0:r1]                           per row range r of at most 16 MB in float32
                                                      (the derivative rule's dequantization and ranges)
    Y   = Concat_r(FusedMatMul(A', W_r, transB=1))  (+ bias)

each range dequantized once the previous range's product is made (one range in float at a time,
read back by its GEMM while still in the CPU's cache).

``Y`` equals the prepacked kernel's output to float32 rounding (test_dequantize_matmul_nbits:
every block size, with and without zero points). The gradient is the node's derivative rule,
expanded before this pass: ``dA = dY · W``, straight through the rounding of ``A``.

Nodes left as they are: a constant ``B`` (onnxruntime prepacks it and runs the deployed kernel
itself), other element types, and what the rule's ``GatherBlockQuantized`` form does not take
(``g_idx``, float zero points: onnxruntime never prepacks those either, so its fallback *is*
the deployed numerics).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from onnx import ModelProto, NodeProto, TensorProto, helper

from ..autodiff.emitter import Emitter, ValueMeta
from ..autodiff.native_ops import DEQUANTIZE_ROWS, INT8_BLOCKS
from ..autodiff.registry import RuleContext, RuleError
from ..autodiff.rules_quantized import QuantizedWeight, row_ranges
from ._graph import rename_values

MS = "com.microsoft"
INT8_LEVEL = 4  # accuracy_level: int8 activations (onnxruntime's CompInt8), where the CPU has the kernel

# (bits, block_size) -> whether onnxruntime's deployed kernel quantizes A to int8 at accuracy_level 4
Int8Blocks = Callable[[int, int], bool]


def dequantize_matmul_nbits(model: ModelProto, int8_blocks: Int8Blocks, native: bool = False) -> ModelProto:
    """Rewrite (in place) every main-graph float32 ``MatMulNBits`` whose ``B`` is not an
    initializer, as the module says; ``int8_blocks(bits, block_size)``: whether the deployed
    kernel quantizes ``A`` to int8 at ``accuracy_level=4`` (onnxruntime's answer on this CPU:
    :func:`onnx_training_ops.runtime.contrib_numerics.int8_blocks`); ``native``: dequantize with
    the native kernel (``TrainingDequantizeRows``, registered with the native kernels) instead of
    ``GatherBlockQuantized``. Returns ``model``."""
    graph = model.graph
    constant = {t.name for t in graph.initializer}
    meta = {vi.name: ValueMeta.from_type(vi.type) for vi in graph.input}
    meta.update({t.name: ValueMeta(t.data_type, tuple(t.dims)) for t in graph.initializer})
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    replaced: dict[int, list[NodeProto]] = {}
    nodes = list(graph.node)  # alive while ids key ``replaced``
    rounded: dict[tuple[str, int, int], str] = {}  # one int8 rounding per input (a split node's chunks, q/k/v...)
    for index, node in enumerate(nodes):
        if node.op_type == "MatMulNBits" and node.domain == MS and node.input[1] not in constant:
            rewritten = _as_gemm(node, meta, opset, index, int8_blocks, rounded, native)
            if rewritten is not None:
                replaced[id(node)] = rewritten
    if replaced:
        kept = [new for node in nodes for new in replaced.get(id(node), [node])]
        del graph.node[:]
        graph.node.extend(kept)
        if not any(o.domain == MS for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(MS, 1))
    return model


def _as_gemm(node: NodeProto, meta: dict[str, ValueMeta], opset: int, index: int,
             int8_blocks: Int8Blocks, rounded: dict[tuple[str, int, int], str], native: bool) -> list[NodeProto] | None:
    if opset < 13 or meta.get(node.input[2], ValueMeta()).dtype != TensorProto.FLOAT:
        return None
    em = Emitter(f"{node.name or node.output[0]}/dequantized_{index}/", opset, meta,
                 frozenset({DEQUANTIZE_ROWS, INT8_BLOCKS}) if native else frozenset())
    ctx = RuleContext(node, [None], [False] * len(node.input), em, {})
    try:
        weight = QuantizedWeight(ctx)
    except RuleError:
        return None
    if weight.g_idx is not None or weight.zp_float:
        return None
    a = node.input[0]
    em.set_meta(a, TensorProto.FLOAT, None)
    x = a
    if int(ctx.attr("accuracy_level", 0)) == INT8_LEVEL and int8_blocks(weight.bits, weight.block):
        key = (a, weight.k, weight.block)
        if key not in rounded and native:
            rounded[key] = em.native_op(INT8_BLOCKS, [a, em.const(np.asarray([weight.block], np.int64), "block")],
                                        "int8")
        elif key not in rounded:
            rounded[key] = int8_rounded(em, a, weight.k, weight.block)
        x = rounded[key]
    parts: list[str] = []
    for rows in row_ranges(weight.n, weight.k):  # one range in float at a time, each made once the last is used
        w = weight.dequantized(parts[-1] if parts else a, node.input[2], rows)
        parts.append(em.op("FusedMatMul", [x, w], "gemm", domain=MS, transB=1))
    y = parts[0] if len(parts) == 1 else em.op("Concat", parts, "rows", axis=-1)
    bias = ctx.input(5)
    if bias is not None:
        y = em.op("Add", [y, bias], "biased")
    rename_values(em.nodes, {y: node.output[0]})
    return em.nodes


def int8_rounded(em: Emitter, a: str, k: int, block: int) -> str:
    """``a`` (float32 ``[..., K]``) quantized to int8 and back per block of ``block`` along its
    last axis, as onnxruntime's int8-activation kernels quantize it: symmetric, scale
    ``max|a| / 127`` per block, rounded half to even (a last partial block padded with zeros;
    an all-zero block stays zero)."""
    blocks = -(-k // block)
    pad = blocks * block - k
    x = em.op("Reshape", [a, em.ints([-1, k])], "rows")
    if pad:
        x = em.op("Pad", [x, em.ints([0, 0, 0, pad])], "padded")
    x = em.op("Reshape", [x, em.ints([-1, blocks, block])], "blocks")
    magnitude = em.op("Abs", [x], "abs")
    amax = em.op("ReduceMax", [magnitude, em.ints([2])], "amax", keepdims=1) if em.opset >= 18 \
        else em.op("ReduceMax", [magnitude], "amax", axes=[2], keepdims=1)
    scale = em.op("Div", [amax, em.const(np.asarray(127.0, np.float32), "int8_max")], "scale")
    # an all-zero block has scale 0: any positive divisor gives its zeros back
    safe = em.op("Max", [scale, em.const(np.asarray(np.finfo(np.float32).tiny, np.float32), "tiny")], "safe")
    x = em.op("Mul", [em.op("Round", [em.op("Div", [x, safe], "scaled")], "q"), scale], "int8")
    x = em.op("Reshape", [x, em.ints([-1, blocks * block])], "rows")
    if pad:
        x = em.op("Slice", [x, em.ints([0]), em.ints([k]), em.ints([1])], "unpadded")
    return em.op("Reshape", [x, em.op("Shape", [a], "shape")], "int8_rounded")


__all__ = ["INT8_LEVEL", "dequantize_matmul_nbits", "int8_rounded"]
