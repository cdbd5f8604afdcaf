"""Which initializers train: torch's notion of parameters, and a derivative rule on every path to the loss."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from ..autodiff.coverage import frozen_reads, missing_rules, trainable_names
from ..autodiff.registry import describe_missing
from ..errors import TrainingOpError, node_label
from ..lora.spec import lora_spec
from .dynamo_params import exported_parameters

FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.DOUBLE)
TORCH_INPUT_KIND = "pkg.torch.export.graph_signature.InputSpec.kind"  # dynamo=True value_info


def _exported_kinds(graph: onnx.GraphProto) -> dict[str, str]:
    """What ``torch.onnx.export(dynamo=True)`` recorded about each initializer:
    ``PARAMETER`` or ``BUFFER``; where the graph carries torch's graph signature, every other
    initializer (the constants it folded) is ``CONSTANT``."""
    kinds = {v.name: p.value for v in [*graph.input, *graph.value_info]
             for p in v.metadata_props if p.key == TORCH_INPUT_KIND}
    params = exported_parameters(graph)
    if params:
        targets = set(params.values())
        kinds.update({t.name: "PARAMETER" if t.name in targets else kinds.get(t.name, "CONSTANT")
                      for t in graph.initializer})
    return kinds


def _default_trainables(model: onnx.ModelProto, loss_nodes, loss_name: str,
                        elem_types) -> list[onnx.TensorProto]:
    """The initializers torch would call parameters: float, not scalars (constants the
    exporters fold into initializers), not buffers (when the exporter says so), not
    BatchNormalization running statistics, and with a differentiable path to the loss."""
    kinds = _exported_kinds(model.graph)
    candidates = [t for t in model.graph.initializer
                  if t.data_type in FLOAT_TYPES and len(t.dims) > 0
                  and kinds.get(t.name, "PARAMETER") == "PARAMETER"]
    reached = trainable_names(list(model.graph.node) + list(loss_nodes), loss_name,
                              [t.name for t in candidates], elem_types)
    chosen = [t for t in candidates if t.name in reached]
    if not chosen:
        if any(t.data_type in (TensorProto.FLOAT16, TensorProto.BFLOAT16) and len(t.dims) > 0
               for t in model.graph.initializer):
            raise TrainingOpError("the model's weights are float16/bfloat16: training keeps float32 master "
                                  "weights; export the model in float32 (torch: model.float() before "
                                  "torch.onnx.export) and build with precision='fp16' or 'bf16' for mixed "
                                  "precision (matmuls in 16-bit, weights and optimizer state in float32)")
        raise TrainingOpError("the model has no float initializers that reach the loss; pass "
                              "trainable=[...]")
    return chosen


def choose_trainables(model: onnx.ModelProto, trainable, loss_nodes, loss_name: str,
                elem_types) -> list[onnx.TensorProto]:
    if trainable is None:
        lora = lora_spec(model)
        if lora is None:
            return _default_trainables(model, loss_nodes, loss_name, elem_types)
        trainable = lora.trainable  # a model from add_lora: its adapters
    inits = {t.name: t for t in model.graph.initializer}
    names = [trainable] if isinstance(trainable, str) else list(trainable)
    if not names:
        raise TrainingOpError("trainable is empty: nothing to train")
    out = []
    for name in names:
        if name not in inits:
            raise TrainingOpError(
                f"trainable {name!r} is not an initializer of the main graph; "
                f"initializers: {', '.join(sorted(inits)) or 'none'}"
            )
        t = inits[name]
        if t.data_type not in FLOAT_TYPES:
            raise TrainingOpError(
                f"trainable {name!r} is {helper.tensor_dtype_to_string(t.data_type)}; only float and double train"
            )
        out.append(t)
    if len(set(names)) != len(names):
        raise TrainingOpError(f"trainable names repeat: {names}")
    frozen, trained = frozen_reads(model.graph.node)
    for name in names:
        if name in frozen and name not in trained:
            node, i = frozen[name]
            raise TrainingOpError(
                f"trainable {name!r} is input {i} of {node_label(node)}, an input that never trains "
                "(a quantized weight and its scales or zero points, rotary tables, running statistics); "
                "train an adapter beside it instead")
    return out


def check_differentiable(model: onnx.ModelProto, loss_nodes, loss_name: str,
                          params: list[onnx.TensorProto], elem_types) -> None:
    """Every op between the trainables and the loss has a derivative rule: else one error
    listing all the missing ones."""
    missing = missing_rules(model.graph, list(model.graph.node) + list(loss_nodes), loss_name,
                            [p.name for p in params], elem_types)
    if missing:
        raise TrainingOpError(describe_missing(missing, f"from the trainables to the loss "
                                                        f"{loss_name!r}"))
