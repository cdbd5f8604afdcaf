"""Reading onnxruntime-training's artifact models: the optimizer model and the eval model.

* :func:`read_optimizer` — the ``com.microsoft::AdamWOptimizer`` node of ``optimizer_model.onnx``
  as an :class:`~.adamw.OrtAdamW` (a missing attribute takes the kernel's default), or its
  ``SGDOptimizerV2`` as ``Momentum(momentum=0)``.
* :func:`split_eval_model` — ``eval_model.onnx`` is the forward graph plus the loss block, with
  the parameters as graph inputs (their values live in the checkpoint). When the loss is
  onnxblock's ``CrossEntropyLoss`` (one ``SoftmaxCrossEntropyLoss`` node reading a forward
  value and a label input), the forward graph becomes the inference model and the loss our
  :class:`~onnx_training_ops.builder.losses.CrossEntropyLoss` with the same attributes. Any other loss
  stays in the model as it is: the whole eval graph is the main graph and its scalar loss output
  is the loss (its label inputs are then inputs of the main graph too).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..builder.losses import CrossEntropyLoss
from ..errors import TrainingOpError
from ..optim.momentum import Momentum
from ..optim.ort_adamw import OrtAdamW

MS_DOMAIN = "com.microsoft"
# AdamWOptimizerBase's defaults when the node lacks an attribute
KERNEL_DEFAULTS = {"alpha": 0.9, "beta": 0.999, "epsilon": 1e-8, "weight_decay": 0.0,
                   "adam_mode": 0, "correct_bias": 1}
_FLOAT, _INT = onnx.AttributeProto.FLOAT, onnx.AttributeProto.INT
ATTRIBUTE_TYPES = {"alpha": (_FLOAT,), "beta": (_FLOAT,), "epsilon": (_FLOAT,), "weight_decay": (_FLOAT,),
                   "adam_mode": (_INT,), "correct_bias": (_INT,)}  # the kernel's schema


def read_optimizer(model: onnx.ModelProto, path: str, lr: float) -> OrtAdamW | Momentum:
    """The optimizer node of the optimizer model at ``path``, with learning rate ``lr``:
    ``AdamWOptimizer`` -> :class:`OrtAdamW` (a missing attribute takes the kernel's default);
    ``SGDOptimizerV2`` (``w - lr * g``) -> ``Momentum(momentum=0)``, the same arithmetic."""
    nodes = [n for n in model.graph.node if n.domain == MS_DOMAIN]
    if len(nodes) != 1 or nodes[0].op_type not in ("AdamWOptimizer", "SGDOptimizerV2"):
        found = ", ".join(f"{n.domain}::{n.op_type}" for n in nodes) or "no optimizer node"
        raise TrainingOpError(f"{path}: expected one com.microsoft::AdamWOptimizer or SGDOptimizerV2 node "
                              f"(what generate_artifacts writes for OptimType.AdamW / SGD), found {found}")
    if nodes[0].op_type == "SGDOptimizerV2":
        return Momentum(lr=lr, momentum=0.0)
    for a in nodes[0].attribute:
        expected = ATTRIBUTE_TYPES.get(a.name)
        if expected is not None and a.type not in expected:
            names = " or ".join(onnx.AttributeProto.AttributeType.Name(t) for t in expected)
            raise TrainingOpError(f"{path}: node {nodes[0].name!r}: attribute {a.name!r} must be {names}, found "
                                  f"{onnx.AttributeProto.AttributeType.Name(a.type)} "
                                  f"{helper.get_attribute_value(a)!r}")
    attrs = {**KERNEL_DEFAULTS, **{a.name: helper.get_attribute_value(a) for a in nodes[0].attribute}}
    try:
        return OrtAdamW(lr=lr, betas=(float(attrs["alpha"]), float(attrs["beta"])),
                        eps=float(attrs["epsilon"]), weight_decay=float(attrs["weight_decay"]),
                        mode=int(attrs["adam_mode"]), bias_correction=bool(attrs["correct_bias"]))
    except TrainingOpError as e:
        raise TrainingOpError(f"{path}: node {nodes[0].name!r}: {e}") from None


@dataclass
class SplitModel:
    """The inference model (parameters still graph inputs), the loss and its label inputs."""

    forward: onnx.ModelProto
    loss: CrossEntropyLoss | str      # our loss object, or the name of the model's scalar loss output
    labels: str | None                # the label input our loss adds (None: kept in the model)
    output: str | None                # the forward output the loss reads


def _consumers(graph: onnx.GraphProto, name: str) -> list[onnx.NodeProto]:
    return [n for n in graph.node if name in n.input]


def _cross_entropy(graph: onnx.GraphProto, node: onnx.NodeProto, path: str) -> CrossEntropyLoss:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    reduction = attrs.get("reduction", b"mean")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    if reduction not in ("mean", "sum"):
        raise TrainingOpError(f"{path}: the loss node {node.name!r} has reduction {reduction!r}; a "
                              "training loss must be a scalar ('mean' or 'sum')")
    weight = None
    if len(node.input) > 2 and node.input[2]:
        inits = {i.name: i for i in graph.initializer}
        if node.input[2] not in inits:
            raise TrainingOpError(f"{path}: the class weights {node.input[2]!r} of {node.name!r} are "
                                  "not an initializer of the eval model")
        weight = tuple(float(w) for w in numpy_helper.to_array(inits[node.input[2]]))
    return CrossEntropyLoss(class_axis=1, ignore_index=attrs.get("ignore_index"), weight=weight,
                            reduction=reduction)


def _typed(model: onnx.ModelProto, name: str) -> onnx.ValueInfoProto:
    """The value info of ``name`` as shape inference finds it (the loss's scores input)."""
    inferred = onnx.shape_inference.infer_shapes(model).graph
    for vi in list(inferred.value_info) + list(inferred.output) + list(inferred.input):
        if vi.name == name:
            return vi
    return onnx.ValueInfoProto(name=name)


def split_eval_model(model: onnx.ModelProto, params: set[str], path: str) -> SplitModel:
    """Cut ``model`` (the eval model) into forward graph and loss; see the module docstring."""
    graph = model.graph
    if not graph.output:
        raise TrainingOpError(f"{path}: the eval model has no outputs (onnxruntime-training puts the loss first)")
    loss_name = graph.output[0].name
    producer = next((n for n in graph.node if loss_name in n.output), None)
    if producer is None:
        raise TrainingOpError(f"{path}: no node computes the loss output {loss_name!r}")
    inputs = {i.name for i in graph.input}
    if producer.op_type == "SoftmaxCrossEntropyLoss" and producer.domain in ("", "ai.onnx") \
            and len(producer.input) >= 2 and producer.input[1] in inputs - params \
            and all(n is producer for n in _consumers(graph, producer.input[1])) \
            and not any(_consumers(graph, o) for o in producer.output if o) \
            and not (set(producer.output[1:]) & {o.name for o in graph.output}):
        loss = _cross_entropy(graph, producer, path)
        label, scores = producer.input[1], producer.input[0]
        forward = onnx.ModelProto()
        forward.CopyFrom(model)
        g = forward.graph
        keep = [n for n in g.node if list(n.output) != list(producer.output)]
        del g.node[:]
        g.node.extend(keep)
        kept_inputs = [i for i in g.input if i.name != label]
        del g.input[:]
        g.input.extend(kept_inputs)
        outputs = [o for o in g.output if o.name != loss_name]
        if scores not in {o.name for o in outputs}:
            outputs.insert(0, _typed(model, scores))
        del g.output[:]
        g.output.extend(outputs)
        if producer.input[2:] and producer.input[2]:
            kept_inits = [i for i in g.initializer if i.name != producer.input[2] or _consumers(g, i.name)]
            del g.initializer[:]
            g.initializer.extend(kept_inits)
        return SplitModel(forward, loss, label, scores)
    return SplitModel(model, loss_name, None, None)


def fill_parameters(model: onnx.ModelProto, values: dict[str, np.ndarray], path: str) -> None:
    """Turn the parameter inputs of ``model`` into initializers holding ``values`` (in place),
    in the order the model declares them (onnxruntime-training's order of the parameters)."""
    declared = {i.name: i for i in model.graph.input}
    missing = sorted(n for n in values if n not in declared)
    if missing:
        raise TrainingOpError(f"{path}: the checkpoint holds parameter(s) {missing} that the eval model "
                              "does not take as inputs: checkpoint and artifacts do not belong together")
    for name, value in values.items():
        tensor_type = declared[name].type.tensor_type
        elem = helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]
        if np.dtype(elem) != value.dtype or (tensor_type.HasField("shape") and
                                             any(d is not None and d != s for d, s in zip(dims, value.shape))
                                             or tensor_type.HasField("shape") and len(dims) != value.ndim):
            raise TrainingOpError(f"{path}: parameter {name!r} is {value.dtype} {list(value.shape)} in "
                                  f"the checkpoint, but the eval model declares {np.dtype(elem)} {dims}")
    order = [i.name for i in model.graph.input if i.name in values]  # the model's, as theirs
    kept = [i for i in model.graph.input if i.name not in values]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    model.graph.initializer.extend(numpy_helper.from_array(values[n], n) for n in order)
