"""Native backward kernels as ``OrtCustomOp`` structs: fixed arity, registered beside the
native optimizers (:func:`.native.register`) in ``ai.onnx.contrib``.

Each op of :data:`OPS` names its kernel (``KernelComputeV2`` cfunc), the
``KernelContext_ParallelFor`` worker it hands to onnxruntime's thread pool (None: one thread),
and its input and output element types. The derivative rules emit these ops only when the Gradient is
expanded for the native path (:data:`onnx_training_ops.passes.NATIVE_PASSES`); every other
path (PyOp fallback, ``prepare(..., portable=True)``) keeps the standard-op rules.
"""

from __future__ import annotations

from collections.abc import Callable

from ..autodiff.native_ops import (
    BATCH_NORM_GRAD,
    BATCH_STATS,
    COL2IM,
    CROSS_ENTROPY_GRAD,
    CROSS_ENTROPY_LOSS,
    DEQUANTIZE_ROWS,
    IM2COL,
    INT8_BLOCKS,
    RELU_GRAD,
)
from .custom_op import (
    _REQUIRED,
    OrtCustomOp,
    _Api,
    cpu_custom_op,
    kernel_state,
    shape_reference,
)

_ANY, _FLOAT, _UINT8, _INT64 = 0, 1, 2, 7
# TrainingReluGrad: one thread below RELU_PARALLEL_MIN elements, else RELU_CHUNK per ParallelFor task
# (2 threads, IOBinding: 32768 elements 10.0 -> 8.3 us, 1M 171 -> 80 us; 16384 no gain)
RELU_PARALLEL_MIN = 1 << 15
RELU_CHUNK = 1 << 14


def _ops() -> dict[str, tuple]:
    """op name -> (compute cfunc, worker cfunc, input types, output types, what it expects)."""
    from ..kernels import _native_dequant_kernels as dk
    from ..kernels import _native_grad_kernels as k
    from ..kernels import _native_norm_kernels as nk

    geometry = f"float32 data and an int64 geometry of {k.GEO_WORDS} values that matches it"
    labels = (f"int64 labels [N] each in [0, C) or equal to the ignore_index, an int64 config of {k.CE_WORDS} "
              "values")
    return {
        IM2COL: (k.im2col_compute, k.im2col_worker, (_FLOAT, _INT64), (_FLOAT,), geometry),
        COL2IM: (k.col2im_compute, k.col2im_worker, (_FLOAT, _INT64), (_FLOAT,), geometry),
        BATCH_NORM_GRAD: (nk.bn_grad_compute, nk.bn_grad_worker, (_FLOAT,) * nk.INPUTS, (_FLOAT,) * 3,
                          "float32 dy, x [N, C, ...] alike, scale, mean, var [C] and a scalar eps"),
        BATCH_STATS: (nk.stats_compute, nk.stats_worker, (_FLOAT,), (_FLOAT, _FLOAT), "float32 x [N, C, ...]"),
        RELU_GRAD: (k.relu_grad_compute, k.relu_grad_worker, (_FLOAT, _FLOAT), (_FLOAT,),
                    "float32 dy and y of one shape"),
        CROSS_ENTROPY_LOSS: (k.cross_entropy_loss_compute, None, (_FLOAT, _INT64, _INT64), (_FLOAT,),
                             "float32 log-probabilities [N, C], " + labels),
        CROSS_ENTROPY_GRAD: (k.cross_entropy_grad_compute, None, (_FLOAT, _FLOAT, _INT64, _INT64), (_FLOAT,),
                             "a float32 gradient of one element, probabilities [N, C], " + labels),
        DEQUANTIZE_ROWS: (dk.dequantize_rows_compute, dk.dequantize_rows_worker, (_UINT8, _FLOAT, _UINT8, _INT64, _ANY),
                          (_FLOAT,), f"uint8 packed rows [N, blocks * block * bits / 8], float32 scales [N, blocks], "
                          f"uint8 zero points [N, ceil(blocks * bits / 8)] or none, an int64 config of "
                          f"{dk.CFG_WORDS} values (bits 2, 4 or 8, block, K, start < stop <= N) and a tensor to "
                          f"run after"),
        INT8_BLOCKS: (dk.int8_blocks_compute, dk.int8_blocks_worker, (_FLOAT, _INT64), (_FLOAT,),
                      "float32 x [..., K] and an int64 config of 1 value (block > 0)"),
    }


def _state(name: str, compute, worker, expects: str) -> Callable[[int, int, _Api], int]:
    def state(api: int, info: int, calls: _Api) -> int:
        """A kernel state for one node (see ``ST_*`` in ``_native_grad_kernels``); the op's first
        node compiles (or loads from numba's cache) its compute function and worker."""
        from ..kernels import _native_grad_kernels as k

        words = [0] * k.ST_WORDS
        words[k.ST_API], words[k.ST_WORKER] = api, worker.address if worker else 0
        words[k.ST_SHAPE_REFERENCE] = shape_reference(api)
        words[k.ST_PARALLEL_MIN], words[k.ST_CHUNK] = RELU_PARALLEL_MIN, RELU_CHUNK
        message = f"{name} node {calls.node_name(info)!r}: expected {expects}".encode() + b"\0"
        return kernel_state(compute.address, words, [message], [k.ST_MESSAGE])

    return state


def custom_ops() -> list[OrtCustomOp]:
    """One ``OrtCustomOp`` per op of :data:`OPS` (kept alive for the process); nothing is compiled
    until onnxruntime creates a kernel of the op."""

    def required(i: int) -> int:
        return _REQUIRED

    return [cpu_custom_op(name, input_types=inputs.__getitem__, input_count=len(inputs),
                          output_types=outputs.__getitem__, output_count=len(outputs),
                          characteristics=(required, required), min_arities=(1, 1),
                          state=_state(name, compute, worker, expects))
            for name, (compute, worker, inputs, outputs, expects) in _ops().items()]
