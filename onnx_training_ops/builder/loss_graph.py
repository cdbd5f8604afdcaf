"""The loss in the algorithm graph: a loss of :mod:`.losses` on a model output, or an output used as it is."""

from __future__ import annotations

from typing import Any

import onnx
from onnx import TensorProto, helper

from ..errors import TrainingOpError
from ..passes._graph import unique_name
from .algorithm import Algorithm, tensor_vi, value_info_from
from .losses import NAMED, CrossEntropyLoss, Emit, Loss, resolve
from .metadata import LabelRange
from .trainables import FLOAT_TYPES


def label_range(spec, types, outputs, output) -> LabelRange | None:
    """The classes and ignore_index when the loss takes class labels and C is static, else None."""
    if not isinstance(spec, CrossEntropyLoss):
        return None
    name = output or next(iter(outputs), None)
    vt = types.get(name) if name else None
    if vt is None or vt.shape is None:
        return None
    try:
        classes = vt.shape[spec.axis(vt.shape)]
    except TrainingOpError:
        return None
    if not isinstance(classes, int):
        return None
    return LabelRange(classes, spec.ignore_index)


def label_shape(spec, types, outputs, output) -> dict[str, Any] | None:
    """The labels' expected shape (the declared shape of the output the loss reads, without
    cross-entropy's class axis) for the session's feed check, or None when unknown."""
    name = output or next(iter(outputs), None)
    vt = types.get(name) if name else None
    if spec is None or vt is None or vt.shape is None:
        return None
    dims = list(vt.shape)
    try:
        axis = spec.axis(vt.shape) if isinstance(spec, CrossEntropyLoss) else None
    except TrainingOpError:
        return None
    expected = dims if axis is None else dims[:axis] + dims[axis + 1:]
    shown = "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"
    return {"output": name, "output_shape": shown, "shape": expected, "class_axis": axis,
            "shift": bool(getattr(spec, "shift_labels", False))}


def _loss_nodes(spec: Loss, graph: onnx.GraphProto, types, outputs, output, labels, taken,
                renamed: dict[str, str]):
    """(loss name, label input name, loss elem type, nodes, label ValueInfo) of ``spec`` on
    the model output ``output`` (default: the first), read under its ``renamed`` name (the
    training-mode copy) if it has one."""
    if output is None:
        if not graph.output:
            raise TrainingOpError("the model has no outputs")
        output = graph.output[0].name
    if output not in outputs:
        raise TrainingOpError(f"output {output!r} is not an output of the model; outputs: {', '.join(outputs)}")
    pred_vt = types.get(output)
    pred_type = pred_vt.elem_type if pred_vt else outputs[output].type.tensor_type.elem_type
    if pred_type in (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16):
        raise TrainingOpError(
            f"output {output!r} is {onnx.helper.tensor_dtype_to_string(pred_type).removeprefix('TensorProto.').lower()}"
            f" for {type(spec).__name__}: training keeps float32 master weights and a float32 loss; export the "
            "model in float32 (torch: model.float() before torch.onnx.export) and build with precision='fp16' "
            "or 'bf16' for mixed precision (matmuls in 16-bit, weights and optimizer state in float32)")
    if pred_type not in FLOAT_TYPES:
        raise TrainingOpError(f"output {output!r} must be float or double for {type(spec).__name__}")
    target = labels or spec.default_label_name
    if target in taken:
        raise TrainingOpError(f"the label input name {target!r} is already used in the model; pass labels=...")
    taken.add(target)
    shape = pred_vt.shape if pred_vt is not None else None
    if spec.integer_labels:
        label_shape = [d if d is not None else f"labels_dim{i}"
                       for i, d in enumerate(spec.label_shape(shape))]
        label_vi = tensor_vi(target, TensorProto.INT64, label_shape)
    else:
        label_vi = value_info_from(outputs[output], target)
    loss_name, nodes = _emit_loss(spec, renamed.get(output, output), target, shape, pred_type, taken, "loss")
    if renamed:  # mode="train": the loss on the eval-mode main graph too, for evaluate()
        eval_name, eval_nodes = _emit_loss(spec, output, target, shape, pred_type, taken, "loss.eval")
        nodes += eval_nodes
    else:
        eval_name = loss_name
    return loss_name, eval_name, target, pred_type, nodes, label_vi


def _emit_loss(spec: Loss, prediction: str, target: str, shape, pred_type: int, taken,
               name: str) -> tuple[str, list[onnx.NodeProto]]:
    """The nodes of ``spec`` on ``prediction`` and ``target``, ending in ``name`` (made unique)."""
    em = Emit(lambda base: unique_name(taken, base), helper.tensor_dtype_to_np_dtype(pred_type))
    value = spec.emit(em, prediction, target, shape)
    final = unique_name(taken, name)
    em.nodes.append(helper.make_node("Identity", [value], [final], name=final))
    return final, em.nodes


def _check_output_loss(loss: str, outputs, types) -> None:
    """A model output used as the loss must be a float scalar."""
    if loss not in outputs:
        raise TrainingOpError(
            f"loss {loss!r} is neither one of {sorted(NAMED)} nor an output of the model; "
            f"outputs: {', '.join(outputs) or 'none'}"
        )
    vt = types.get(loss)
    if vt is not None and (vt.elem_type not in FLOAT_TYPES or (vt.shape is not None and
                                                              any(d != 1 for d in vt.shape))):
        raise TrainingOpError(
            f"loss output {loss!r} must be a float scalar, found {vt.dtype_name} of shape {list(vt.shape or [])}"
        )


def add_loss(model: onnx.ModelProto, loss, output, labels, types, renamed,
          algo: Algorithm) -> tuple[Loss | None, str, str, str]:
    """(the loss spec or None, loss name, eval-mode loss name, label input name or ""): the
    loss nodes, their label input and the loss as an output, or a scalar output of the model
    used as it is. The eval-mode loss (``mode="train"``: on the main graph, an output of no
    graph, so steps never run it) is what :meth:`TrainingSession.evaluate` computes."""
    outputs = {o.name: o for o in model.graph.output}
    spec = resolve(loss)
    if spec is None:
        _check_output_loss(loss, outputs, types)
        train_name = renamed.get(loss, loss)  # mode="train": the training-mode copy's value
        if train_name != loss:
            algo.outputs.append(tensor_vi(train_name, outputs[loss].type.tensor_type.elem_type, []))
        return None, train_name, loss, ""
    loss_name, eval_name, target, loss_type, loss_nodes, label_vi = _loss_nodes(
        spec, model.graph, types, outputs, output, labels, algo.taken, renamed)
    algo.nodes += loss_nodes
    algo.inputs.append(label_vi)
    algo.outputs.append(tensor_vi(loss_name, loss_type, []))
    if eval_name != loss_name:
        algo.value_info.append(tensor_vi(eval_name, loss_type, []))
    return spec, loss_name, eval_name, target
