"""Which initializers train: torch's notion of parameters, and a derivative rule on every path to the loss."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from ..autodiff.coverage import frozen_reads, missing_rules, trainable_names
from ..autodiff.registry import describe_missing
from ..errors import TrainingOpError, node_label
from ..lora.spec import lora_spec
from .dynamo_params import Restored, exported_parameters
from .param_groups import frozen_by
from .torch_record import PARAMETERS_KEY
from .torch_record import read as read_record

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


def _is_parameter(model: onnx.ModelProto):
    """Whether an initializer is what torch calls a trainable parameter: float; where the
    module's parameters were recorded (``record_torch_names(model, module)``), one that holds
    a parameter requiring a gradient; else not a buffer or a folded constant of a dynamo
    export, and of rank >= 1 unless the export's signature lists it (rank-0 constants are what
    exporters fold; CLIP's ``logit_scale`` is a parameter)."""
    kinds = _exported_kinds(model.graph)
    signature = set((exported_parameters(model.graph) or {}).values())
    grads = read_record(model, PARAMETERS_KEY)
    names = {k: e["torch"] for k, e in (read_record(model) or {}).items()}

    def check(t: onnx.TensorProto) -> bool:
        if t.data_type not in FLOAT_TYPES:
            return False
        if grads is not None:
            return any(grads.get(n, False) for n in names.get(t.name, [t.name]))
        return kinds.get(t.name, "PARAMETER") == "PARAMETER" and (len(t.dims) > 0 or t.name in signature)
    return check


def _default_trainables(model: onnx.ModelProto, loss_nodes, loss_name: str,
                        elem_types) -> list[onnx.TensorProto]:
    """The initializers torch would call parameters (:func:`_is_parameter`), not BatchNormalization
    running statistics, and with a differentiable path to the loss."""
    is_parameter = _is_parameter(model)
    candidates = [t for t in model.graph.initializer if is_parameter(t)]
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
                      elem_types, restored: Restored | None = None) -> list[onnx.TensorProto]:
    if trainable is None:
        lora = lora_spec(model)
        if lora is None:
            return _default_trainables(model, loss_nodes, loss_name, elem_types)
        trainable = lora.trainable  # a model from add_lora: its adapters
    inits = {t.name: t for t in model.graph.initializer}
    names = [trainable] if isinstance(trainable, str) else list(trainable)
    if not names:
        raise TrainingOpError("trainable is empty: nothing to train")
    lost = [n for n in names if n in restored.lost] if restored is not None else []
    if restored is not None and lost:
        raise TrainingOpError(restored.lost_message(lost))
    if len(set(names)) != len(names):
        raise TrainingOpError(f"trainable names repeat: {names}")
    names = _initializer_names(model, names, inits)
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
    frozen, trained = frozen_reads(model.graph.node)
    for name in names:
        if name in frozen and name not in trained:
            node, i = frozen[name]
            raise TrainingOpError(
                f"trainable {name!r} is input {i} of {node_label(node)}, an input that never trains "
                "(a quantized weight and its scales or zero points, rotary tables, running statistics); "
                "train an adapter beside it instead")
    return out


def _initializer_names(model: onnx.ModelProto, names: list[str], inits) -> list[str]:
    """``names`` as initializer names: a torch name that the torch-name record maps to an
    initializer of another name (the TorchScript exporter's ``onnx::MatMul_398``, which holds
    the weight transposed: the optimizers are elementwise, so it trains the same) becomes
    that initializer's; the names of one tied tensor count once."""
    by_torch = {t: k for k, e in (read_record(model) or {}).items() for t in e["torch"] if k in inits}
    out: list[str] = []
    for name in names:
        name = name if name in inits else by_torch.get(name, name)
        if name not in out:
            out.append(name)
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


def refuse_lost(restored: Restored, trainable, training: list[str], param_groups, initializers: set[str]) -> None:
    """A parameter the export folded or merged beyond repair (``restored.lost``) must not train:
    it would train apart from torch, or not at all. It may stay frozen: by ``trainable=[...]``
    without it, a frozen param group, or (a parameter the model holds) not being a trainable.
    Nor may a frozen one stand in an initializer that trains (its uses would change)."""
    if not restored.lost:
        return
    training_set = set(training)
    would = []
    for name in restored.lost:
        if name in training_set:
            would.append(name)
        elif trainable is None and name not in initializers and not frozen_by(param_groups, name):
            would.append(name)  # torch trains it; the export lost it
        elif restored.stand_ins.get(name, set()) & training_set:
            restored.lost[name] += (f"; it is frozen but reads {', '.join(sorted(restored.stand_ins[name]))}, "
                                    "which trains")
            would.append(name)
    if would:
        raise TrainingOpError(restored.lost_message(would))
