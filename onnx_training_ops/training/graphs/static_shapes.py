"""A step model with its data inputs' shapes fixed, and the shape arithmetic they make constant folded.

An exported step keeps symbolic dims (the batch size, the sequence length), so its gradient
carries shape arithmetic (Shape, Size, int64 Div/Reshape/Concat on them) that runs at every
step. On a device that arithmetic is a host round trip (onnxruntime's CUDA EP copies the
shapes to the host and back: the Memcpy nodes of the exported GPT-2 step); WebGPU does not run
it at all. With the shapes fixed it is constant: :func:`static_step` folds it away.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper

from ...errors import TrainingOpError
from ...passes._graph import onnx_infers, value_types
from ...passes.fold_constants import fold_constants
from ...storage.tensors import location
from .pruning import used_names


def checked_input_shapes(shapes: Any, what: str) -> dict[str, list[int]]:
    """``input_shapes`` checked: a mapping of input names to lists of whole numbers > 0.

    Raises:
        TrainingOpError: anything else (a bare number, a string, 0, a negative or fractional
            dim, nan), naming the input and what was given.
    """
    if not isinstance(shapes, Mapping):
        raise TrainingOpError(f"{what}: input_shapes must map input names to lists of dims "
                              f"({{'input_ids': [8, 256]}}), found {type(shapes).__name__} {shapes!r}")
    checked = {}
    for name, dims in shapes.items():
        values = _whole_dims(dims)
        if values is None:
            raise TrainingOpError(f"{what}: input_shapes[{name!r}] must be a list of whole numbers > 0 "
                                  f"(a static shape, e.g. [8, 256]), found {dims!r}")
        checked[str(name)] = values
    return checked


def _whole_dims(dims: Any) -> list[int] | None:
    if isinstance(dims, (str, bytes, Mapping)) or not hasattr(dims, "__iter__"):
        return None
    values = []
    for d in dims:
        if isinstance(d, (bool, np.bool_)):
            return None
        if isinstance(d, (int, np.integer)):
            value = int(d)
        elif isinstance(d, (float, np.floating)) and math.isfinite(d) and float(d).is_integer():
            value = int(d)
        else:
            return None
        if value < 1:
            return None
        values.append(value)
    return values or None


def fix_input_shapes(model: onnx.ModelProto, data: Sequence[str], shapes: Mapping[str, Sequence[int]],
                     what: str) -> None:
    """Give the data inputs ``data`` of ``model`` static shapes (in place).

    Args:
        model: the step (or eval) model.
        data: its data inputs; each needs a static shape, from ``shapes`` or its own.
        shapes: input name -> dims, for the inputs whose dims are symbolic.
        what: how messages name the caller (``"export (webgpu)"``).

    Raises:
        TrainingOpError: invalid dims (:func:`checked_input_shapes`), a shape that does not fit
            the input, two values for one named dim the inputs share (``N`` of ``input`` and of
            ``labels``), shapes the graph's ops refuse together, an input left symbolic, or a
            name that is no data input.
    """
    shapes = checked_input_shapes(shapes, what)
    unknown = set(shapes) - set(data)
    if unknown:
        raise TrainingOpError(f"{what}: input_shapes names {sorted(unknown)}, not data inputs "
                              f"of the step ({', '.join(data)})")
    named: dict[str, tuple[int, str]] = {}  # a symbolic dim -> its value and the input that gave it
    for vi in model.graph.input:
        if vi.name not in data:
            continue
        dims = vi.type.tensor_type.shape.dim
        found = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in dims]
        given = shapes.get(vi.name)
        if given is not None:
            if len(given) != len(dims) or any(d.HasField("dim_value") and d.dim_value != g
                                              for d, g in zip(dims, given)):
                raise TrainingOpError(f"{what}: input_shapes[{vi.name!r}] is {given}; the input's shape is {found}")
            for d, g in zip(dims, given):
                if d.dim_param:
                    first = named.setdefault(d.dim_param, (g, vi.name))
                    if first[0] != g:
                        raise TrainingOpError(
                            f"{what}: input_shapes give the dim {d.dim_param!r} that {first[1]!r} and {vi.name!r} "
                            f"share two values: {first[0]} ({first[1]!r}) and {g} ({vi.name!r})")
                d.Clear()
                d.dim_value = g
        elif not all(d.HasField("dim_value") for d in dims):
            raise TrainingOpError(f"{what}: input {vi.name!r} has shape {found}; the shapes are folded "
                                  "statically: pass input_shapes={name: [dims]} (--input-shape NAME=D,D,... in the "
                                  "CLI) for every data input")
    _check_inferable(model, {n: shapes[n] for n in shapes}, what)


def _check_inferable(model: onnx.ModelProto, shapes: Mapping[str, list[int]], what: str) -> None:
    """onnx's shape inference over the graph with the fixed shapes, its refusal as a TrainingOpError
    (data inputs whose shapes contradict each other: ``labels`` [5] for ``input`` [4, 8]). The
    graph's own ``value_info`` is left out but for the outputs of ops onnx does not know (the
    contrib ops, through which nothing else would be inferred): an exporter's annotation of an
    inner value may be stale (onnxruntime-genai's builder declares a constant of shape [1] as a
    scalar)."""
    graph = model.graph
    annotations = list(graph.value_info)
    opaque = {o for n in graph.node if not onnx_infers(n) for o in n.output if o}
    del graph.value_info[:]
    graph.value_info.extend(vi for vi in annotations if vi.name in opaque)
    unknown = opaque - {vi.name for vi in graph.value_info}
    if unknown:  # as the passes know them (through the contrib ops)
        types = value_types(model)
        graph.value_info.extend(helper.make_tensor_value_info(n, types[n].elem_type, types[n].shape)
                                for n in sorted(unknown) if n in types and types[n].elem_type)
    try:
        onnx.shape_inference.infer_shapes(model, strict_mode=True)
    except onnx.shape_inference.InferenceError as error:
        given = ", ".join(f"{k}: {v}" for k, v in shapes.items())
        text = str(error).strip()  # "[ShapeInferenceError] Inference error(s): (op_type:Mul, node name: n): ..."
        detail = text.splitlines()[0].partition("Inference error(s): ")[2] or text or type(error).__name__
        raise TrainingOpError(f"{what}: the graph does not take these shapes together ({given}): {detail}") from None
    finally:
        del graph.value_info[:]
        graph.value_info.extend(annotations)


def fold_with_onnxruntime(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxruntime's basic (provider-independent) optimizations, on the CPU: constant folding
    with the static shapes, dead-node removal. Returns the folded model."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.log_severity_level = 3  # the unused initializers it drops are expected
    with tempfile.TemporaryDirectory() as tmp:
        options.optimized_model_filepath = os.path.join(tmp, "folded.onnx")
        # ReshapeFusion names its shape initializers "_new_shape..." unique among its own run only: a
        # model it rewrote once fails the next fold ("Shape of initializer _new_shape does not
        # match"); with static shapes constant folding makes those Reshape targets constant anyway
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"],
                             disabled_optimizers=["ReshapeFusion"])
        folded = onnx.load(options.optimized_model_filepath)
    used = {n.domain for n in folded.graph.node}  # onnxruntime lists every domain it registers
    kept = [o for o in folded.opset_import if o.domain in ("", "ai.onnx", "ai.onnx.ml") or o.domain in used]
    del folded.opset_import[:]
    folded.opset_import.extend(kept)
    for entry in model.metadata_props:  # the optimized file keeps no metadata (the feedback record)
        folded.metadata_props.add(key=entry.key, value=entry.value)
    return folded


def static_step(step: onnx.ModelProto, data: Sequence[str], shapes: Mapping[str, Sequence[int]],
                what: str) -> onnx.ModelProto:
    """A copy of ``step`` with the data inputs' shapes fixed and every Shape/Size they make
    constant folded, with what reads them (:func:`~...passes.fold_constants.fold_constants`:
    in numpy, not an onnxruntime CPU session, which refuses bfloat16 nodes and computes float16
    ones in float32 between casts it would leave in the model).

    Raises:
        TrainingOpError: as :func:`fix_input_shapes`.
    """
    model = onnx.ModelProto()
    model.CopyFrom(step)
    fix_input_shapes(model, data, shapes, what)
    # the graph's annotations of inner values keep the symbolic dims (onnxruntime-genai writes them):
    # inference, through the contrib ops too (passes/_graph.value_types), finds the static ones
    del model.graph.value_info[:]
    return fold_constants(model)


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
