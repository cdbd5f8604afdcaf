"""The WebGPU step (``export_step(..., target="webgpu")``): the exported step rewritten so that
every node runs on onnxruntime-web's WebGPU execution provider.

What that provider lacks (onnxruntime-web 1.30, measured in Chromium): LogSoftmax, OneHot and
Sum kernels, ``GatherBlockQuantized`` of uint8 data, any float64 op, and int64 arithmetic (CPU
fallback, or 32-bit with int64 on). onnxruntime's contrib ops of a model that has them
(onnxruntime-genai's ``MatMulNBits``, ``GroupQueryAttention``...) stay: WebGPU runs those.
The rewrite, in named passes (``onnx_training_ops/passes/``):

1. the data inputs get static shapes (``input_shapes``, or the model's own);
2. :func:`split_host_scalars`: the update count and what depends on it alone (bias
   corrections in float64, ``T + 1``) leave the graph for a host program the trainer
   evaluates on the CPU; the graph reads the resulting float32 scalars as inputs;
3. :func:`lower_log_softmax`, :func:`lower_one_hot`, :func:`lower_sum`, :func:`lower_is_nan`,
   :func:`maxpool_gradient_by_mask` (WebGPU's MaxPool has no Indices output),
   :func:`dequantize_with_float_ops` (the ``MatMulNBits`` gradient's dequantization:
   ``GatherBlockQuantized`` of uint8 data has no WebGPU kernel);
4. :func:`int32_inputs`: labels and ids are int32 inputs, their index arithmetic int32;
   :func:`slice_as_pad`: an int32 Slice (a causal LM's label shift) becomes a cropping Pad
   (WebGPU's Slice is float-only);
5. :func:`fold_static_shapes` (Shape, Size) and onnxruntime's basic graph optimizations on the CPU
   fold what the static shapes make constant (Shape, Size and the int64 arithmetic on them) and
   drop dead nodes.

The result computes what the portable step computes, to float32 rounding
(``tests/test_webgpu_step.py`` runs both in onnxruntime's CPU provider).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import onnx
from onnx import TensorProto

from ..errors import TrainingOpError
from ..passes.dequantize_with_float_ops import dequantize_with_float_ops
from ..passes.fold_static_shapes import fold_static_shapes
from ..passes.int32_inputs import int32_inputs
from ..passes.lower_is_nan import lower_is_nan
from ..passes.lower_log_softmax import lower_log_softmax
from ..passes.lower_one_hot import lower_one_hot
from ..passes.lower_sum import lower_sum
from ..passes.maxpool_gradient_by_mask import maxpool_gradient_by_mask
from ..passes.slice_as_pad import slice_as_pad
from ..passes.split_host_scalars import split_host_scalars
from ..training.graphs.static_shapes import fix_input_shapes, fold_with_onnxruntime

FILE = "step.webgpu.onnx"
EVAL_FILE = "eval.webgpu.onnx"


def webgpu_step(step: onnx.ModelProto, state: Sequence[str], counter: str | None, rates: Sequence[str],
                input_shapes: Mapping[str, Sequence[int]] | None = None) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """The WebGPU step of a portable exported step model.

    Args:
        step: the portable step (:func:`~onnx_training_ops.export.graphs.step_graph`).
        state: the state input names.
        counter: the update count input (computed on the host), or None.
        rates: the learning-rate inputs.
        input_shapes: static shapes of the data inputs whose shapes are symbolic.

    Returns:
        ``(model, webgpu)``: the step model and its manifest section (``host``: the host
        program; ``int32``: inputs now int32; ``inputs``: the graph's inputs in order).

    Raises:
        TrainingOpError: a data input without a static shape, or a graph the passes refuse.
    """
    model = onnx.ModelProto()
    model.CopyFrom(step)
    data = [vi.name for vi in model.graph.input if vi.name not in set(state) and vi.name not in set(rates)]
    fix_input_shapes(model, data, dict(input_shapes or {}), "export (webgpu)")
    model, host = split_host_scalars(model, [n for n in (counter, *rates) if n])
    for run in (fold_static_shapes, lower_log_softmax, lower_one_hot, lower_sum, lower_is_nan,
                maxpool_gradient_by_mask, dequantize_with_float_ops):
        model = run(model)
    model = fold_static_shapes(fold_with_onnxruntime(model))  # what the folding made constant (a NonZero input)
    narrowed = int32_inputs(model, skip=state)
    model = fold_with_onnxruntime(slice_as_pad(model))
    leftovers = sorted({vi.name for vi in model.graph.input if vi.type.tensor_type.elem_type == TensorProto.DOUBLE})
    if leftovers:
        raise TrainingOpError(f"export (webgpu): inputs {leftovers} are float64; WebGPU runs no float64")
    return model, {"host": host, "int32": narrowed, "inputs": [vi.name for vi in model.graph.input]}
