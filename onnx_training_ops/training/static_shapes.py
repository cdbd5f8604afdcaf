"""A step model with its data inputs' shapes fixed, and the shape arithmetic they make constant folded.

An exported step keeps symbolic dims (the batch size, the sequence length), so its gradient
carries shape arithmetic (Shape, Size, int64 Div/Reshape/Concat on them) that runs at every
step. On a device that arithmetic is a host round trip (onnxruntime's CUDA EP copies the
shapes to the host and back: the Memcpy nodes of the exported GPT-2 step); WebGPU does not run
it at all. With the shapes fixed it is constant: :func:`static_step` folds it away.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence

import onnx
from onnx import helper

from ..errors import TrainingOpError
from ..passes.fold_static_shapes import fold_static_shapes
from ..storage.tensors import location
from .pruning import used_names


def fix_input_shapes(model: onnx.ModelProto, data: Sequence[str], shapes: Mapping[str, Sequence[int]],
                     what: str) -> None:
    """Give the data inputs ``data`` of ``model`` static shapes (in place).

    Args:
        model: the step (or eval) model.
        data: its data inputs; each needs a static shape, from ``shapes`` or its own.
        shapes: input name -> dims, for the inputs whose dims are symbolic.
        what: how messages name the caller (``"export (webgpu)"``).

    Raises:
        TrainingOpError: a shape that does not fit the input, an input left symbolic, or a name
            that is no data input.
    """
    for vi in model.graph.input:
        if vi.name not in data:
            continue
        dims = vi.type.tensor_type.shape.dim
        found = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in dims]
        given = shapes.get(vi.name)
        if given is not None:
            given = [int(d) for d in given]
            if len(given) != len(dims) or any(d.HasField("dim_value") and d.dim_value != g
                                              for d, g in zip(dims, given)):
                raise TrainingOpError(f"{what}: input_shapes[{vi.name!r}] is {given}; the input's shape is {found}")
            for d, g in zip(dims, given):
                d.Clear()
                d.dim_value = g
        elif not all(d.HasField("dim_value") for d in dims):
            raise TrainingOpError(f"{what}: input {vi.name!r} has shape {found}; the shapes are folded "
                                  "statically: pass input_shapes={name: [dims]} (--input-shape NAME=D,D,... in the "
                                  "CLI) for every data input")
    unknown = set(shapes) - set(data)
    if unknown:
        raise TrainingOpError(f"{what}: input_shapes names {sorted(unknown)}, not data inputs "
                              f"of the step ({', '.join(data)})")


def fold_with_onnxruntime(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxruntime's basic (provider-independent) optimizations, on the CPU: constant folding
    with the static shapes, dead-node removal. Returns the folded model."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.log_severity_level = 3  # the unused initializers it drops are expected
    with tempfile.TemporaryDirectory() as tmp:
        options.optimized_model_filepath = os.path.join(tmp, "folded.onnx")
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        folded = onnx.load(options.optimized_model_filepath)
    kept = [o for o in folded.opset_import if o.domain in ("", "ai.onnx", "ai.onnx.ml")]
    del folded.opset_import[:]
    folded.opset_import.extend(kept)
    for entry in model.metadata_props:  # the optimized file keeps no metadata (the feedback record)
        folded.metadata_props.add(key=entry.key, value=entry.value)
    return folded


def static_step(step: onnx.ModelProto, data: Sequence[str], shapes: Mapping[str, Sequence[int]],
                what: str) -> onnx.ModelProto:
    """A copy of ``step`` with the data inputs' shapes fixed and every Shape/Size they make
    constant folded, with what reads them.

    Raises:
        TrainingOpError: as :func:`fix_input_shapes`.
    """
    model = onnx.ModelProto()
    model.CopyFrom(step)
    fix_input_shapes(model, data, shapes, what)
    return fold_static_shapes(fold_with_onnxruntime(fold_static_shapes(model)))


def static_graph(model: onnx.ModelProto, data: Sequence[str], shapes: Mapping[str, Sequence[int]],
                 what: str) -> onnx.ModelProto:
    """:func:`static_step` for a graph whose big initializers live outside the message (a
    session's model: their ``location`` names an array beside it). They become inputs while
    onnxruntime folds the shapes (nothing that reads a weight folds), then initializers again."""
    detached = [t for t in model.graph.initializer if location(t) is not None]
    if not detached:
        return static_step(model, data, shapes, what)
    light = onnx.ModelProto()
    light.CopyFrom(model)
    names = {t.name for t in detached}
    kept = [t for t in light.graph.initializer if t.name not in names]
    del light.graph.initializer[:]
    light.graph.initializer.extend(kept)
    light.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in detached)
    folded = static_step(light, data, shapes, what)
    inputs = [vi for vi in folded.graph.input if vi.name not in names]
    del folded.graph.input[:]
    folded.graph.input.extend(inputs)
    read = used_names(folded.graph)  # a weight only shape arithmetic read is folded away
    folded.graph.initializer.extend(t for t in detached if t.name in read)
    return folded
