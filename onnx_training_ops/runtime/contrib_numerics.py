"""What onnxruntime's CPU contrib kernels compute on this machine, asked of onnxruntime itself.

:func:`int8_blocks`: whether the prepacked ``MatMulNBits`` quantizes its input to int8 at
``accuracy_level=4`` for a (bits, block_size). That depends on the onnxruntime build and the CPU
(MLAS has int8 kernels for some block sizes and instruction sets only, and falls back to float
otherwise), so it is measured once per process on a small node: the answer
:func:`~onnx_training_ops.passes.dequantize_matmul_nbits.dequantize_matmul_nbits` needs to keep a
training graph's numerics the deployed model's.
"""

from __future__ import annotations

import functools

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

MS = "com.microsoft"


@functools.cache
def int8_blocks(bits: int, block_size: int) -> bool:
    """Whether onnxruntime's CPU ``MatMulNBits`` (float32, weight prepacked) quantizes ``A`` to
    int8 at ``accuracy_level=4`` for ``bits`` and ``block_size``: its output then differs from
    ``accuracy_level=1``'s by the rounding of ``A`` (about 1e-3 relative; float rounding is 1e-7).
    False where onnxruntime cannot run the node at all."""
    k, n, m = 4 * block_size, 8, 4
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (n, k // block_size, block_size * bits // 8), dtype=np.uint8)
    scales = rng.uniform(0.5, 1.0, (n, k // block_size)).astype(np.float32)
    a = rng.standard_normal((m, k)).astype(np.float32)
    try:
        y1, y4 = (_run(packed, scales, a, k, n, bits, block_size, level) for level in (1, 4))
    except Exception:  # noqa: BLE001 - a build without the kernel: nothing to match
        return False
    return bool(np.abs(y4 - y1).max() > 1e-4 * max(float(np.abs(y1).max()), 1.0))


def _run(packed: np.ndarray, scales: np.ndarray, a: np.ndarray, k: int, n: int, bits: int, block_size: int,
         level: int) -> np.ndarray:
    node = helper.make_node("MatMulNBits", ["A", "B", "scales"], ["Y"], domain=MS, K=k, N=n, bits=bits,
                            block_size=block_size, accuracy_level=level)
    graph = helper.make_graph([node], "probe", [helper.make_tensor_value_info("A", TensorProto.FLOAT, list(a.shape))],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales, "scales")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)],
                              ir_version=8)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"A": a})[0]


__all__ = ["int8_blocks"]
