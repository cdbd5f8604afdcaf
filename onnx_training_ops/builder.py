"""Inference model + loss + optimizer -> one ONNX training model (``ModelProto.training_info``).

The result follows the IR spec ("Training Related Information"): the main graph is the
inference graph, unchanged; one TrainingInfoProto holds

* ``initialization``: the optimizer state (V, H) at its initial value and T = 0,
  bound by ``initialization_binding``;
* ``algorithm``: the loss over the main graph's output, one ``Gradient`` node for all
  trainables, **one** multi-tensor optimizer node and T <- T + 1, bound by
  ``update_binding`` (every parameter, V, H and T).

The spec runs the algorithm on the main graph and the algorithm graph concatenated, so the
forward pass is the main graph itself: the algorithm's nodes read the main graph's inputs
and outputs by name and the algorithm adds only the loss inputs (``labels`` or ``target``)
and the learning rate (``learning_rate``, a float scalar input whose initializer holds the
optimizer's ``lr`` as default, so schedules just feed it).

Optimizer state lives in the algorithm graph's initializers (``<param>.V``, ``<param>.H``,
``optimizer.T``); the spec lets update bindings name them, and the main graph stays as it was.

:func:`build_training_model` runs named steps in order: ``_forward`` (the forward pass the
loss reads: the main graph in ``mode="eval"``, a training-mode copy in ``mode="train"``),
``_loss``, ``_trainables`` and ``_check_differentiable`` (every op without a derivative rule
listed at once, :mod:`.autodiff.coverage`), ``_learning_rate``, ``_update`` (T + 1, one
Gradient, one optimizer node, their bindings), ``_initialization``, ``_finish`` (versions,
metadata).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .autodiff.coverage import missing_rules, trainable_names
from .autodiff.registry import describe_missing
from .errors import TrainingOpError
from .losses import NAMED, CrossEntropyLoss, Emit, Loss, resolve
from . import sparse_updates as sparse_updates_
from .grad_clip import checked_limit, clip_by_global_norm, clip_by_value
from .optimizers import Adagrad, Adam, Momentum, Optimizer, to_json
from .param_groups import Group, groups_to_json, resolve_groups
from .rmsprop import RMSProp
from .update_graph import Ops, emit_update
from .passes import load_model
from .passes._graph import all_names, unique_name, value_types
from .passes.fit_runtime import fit_runtime, runtime_limits
from .schema import DOMAIN, OPSET_VERSION
from .train_mode import fit_opset, to_inference, training_forward

META_PREFIX = "onnx_training_ops."
FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.DOUBLE)
MIN_OPSET = 13
TORCH_INPUT_KIND = "pkg.torch.export.graph_signature.InputSpec.kind"  # dynamo=True value_info


def _value_info_from(vi: onnx.ValueInfoProto, name: str) -> onnx.ValueInfoProto:
    out = onnx.ValueInfoProto()
    out.CopyFrom(vi)
    out.name = name
    return out


def _tensor_vi(name: str, elem_type: int, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, list(shape) if shape is not None else None)


def _default_opset(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return o.version
    raise TrainingOpError("the model imports no ai.onnx opset")


def _fit_opset(model: onnx.ModelProto) -> onnx.ModelProto:
    """ai.onnx opset >= 13 (SoftmaxCrossEntropyLoss, ReduceMean forms); fit_runtime clamps the top."""
    opset = _default_opset(model)
    if opset < MIN_OPSET:
        try:
            model = onnx.version_converter.convert_version(model, MIN_OPSET)
        except Exception as error:  # noqa: BLE001
            raise TrainingOpError(
                f"the model imports ai.onnx opset {opset}; training models need >= {MIN_OPSET} and "
                f"onnx.version_converter failed: {error}"
            ) from error
    return model


def _exported_kinds(graph: onnx.GraphProto) -> dict[str, str]:
    """What ``torch.onnx.export(dynamo=True)`` recorded about each initializer:
    ``PARAMETER`` or ``BUFFER`` (values it folded carry nothing)."""
    return {v.name: p.value for v in [*graph.input, *graph.value_info]
            for p in v.metadata_props if p.key == TORCH_INPUT_KIND}


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
        raise TrainingOpError("the model has no float initializers that reach the loss; pass "
                              "trainable=[...]")
    return chosen


def _trainables(model: onnx.ModelProto, trainable, loss_nodes, loss_name: str,
                elem_types) -> list[onnx.TensorProto]:
    if trainable is None:
        return _default_trainables(model, loss_nodes, loss_name, elem_types)
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
    return out


def _check_differentiable(model: onnx.ModelProto, loss_nodes, loss_name: str,
                          params: list[onnx.TensorProto], elem_types) -> None:
    """Every op between the trainables and the loss has a derivative rule: else one error
    listing all the missing ones."""
    missing = missing_rules(model.graph, list(model.graph.node) + list(loss_nodes), loss_name,
                            [p.name for p in params], elem_types)
    if missing:
        raise TrainingOpError(describe_missing(missing, f"from the trainables to the loss "
                                                        f"{loss_name!r}"))


def _label_range(spec, types, outputs, output) -> str:
    """'C,ignore_index' when the loss takes class labels and C is static, else ''."""
    if not isinstance(spec, CrossEntropyLoss):
        return ""
    name = output or next(iter(outputs), None)
    vt = types.get(name) if name else None
    if vt is None or vt.shape is None:
        return ""
    try:
        classes = vt.shape[spec.axis(vt.shape)]
    except TrainingOpError:
        return ""
    if not isinstance(classes, int):
        return ""
    return f"{classes},{'' if spec.ignore_index is None else spec.ignore_index}"


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
        label_vi = _tensor_vi(target, TensorProto.INT64, label_shape)
    else:
        label_vi = _value_info_from(outputs[output], target)
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


def _initialization(params, groups: list[Group], state_names: dict[str, str], t_name: str,
                    taken: set[str], algo_inits: list) -> tuple[onnx.GraphProto, list[tuple[str, str]]]:
    """The initialization graph (V/H at their group's initial value, T = 0) and its binding;
    the state initializers (same values) are appended to ``algo_inits``."""
    init_nodes, init_outputs, init_binding = [], [], []
    init_t = unique_name(taken, "optimizer.T.init")
    init_nodes.append(
        helper.make_node("Constant", [], [init_t], value=numpy_helper.from_array(np.array(0, np.int64)),
                         name=unique_name(taken, "init/T"))
    )
    init_outputs.append(_tensor_vi(init_t, TensorProto.INT64, []))
    init_binding.append((t_name, init_t))
    optimizer_of = {p: g.optimizer for g in groups for p in g.params}
    for p in params:
        optimizer = optimizer_of[p.name]
        dtype = helper.tensor_dtype_to_np_dtype(p.data_type)
        shape_name = unique_name(taken, f"{p.name}.shape")
        init_nodes.append(
            helper.make_node("Constant", [], [shape_name], value=numpy_helper.from_array(np.array(p.dims, np.int64)),
                             name=unique_name(taken, f"init/{p.name}.shape"))
        )
        for s in optimizer.states:
            state = state_names[f"{p.name}\0{s}"]
            value = optimizer.initial_value(s)
            algo_inits.append(numpy_helper.from_array(np.full(tuple(p.dims), value, dtype), state))
            out = unique_name(taken, f"{state}.init")
            init_nodes.append(
                helper.make_node(
                    "ConstantOfShape", [shape_name], [out], name=unique_name(taken, f"init/{state}"),
                    value=numpy_helper.from_array(np.array([value], dtype)),
                )
            )
            init_outputs.append(_tensor_vi(out, p.data_type, p.dims))
            init_binding.append((state, out))
    return helper.make_graph(init_nodes, "initialization", [], init_outputs), init_binding


@dataclass
class _Algorithm:
    """The algorithm graph as the steps build it, and its update binding."""

    taken: set[str]
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    inputs: list[onnx.ValueInfoProto] = field(default_factory=list)
    inits: list[onnx.TensorProto] = field(default_factory=list)
    outputs: list[onnx.ValueInfoProto] = field(default_factory=list)
    value_info: list[onnx.ValueInfoProto] = field(default_factory=list)
    binding: list[tuple[str, str]] = field(default_factory=list)

    def name(self, base: str) -> str:
        return unique_name(self.taken, base)

    def bind(self, state: str, new: str, elem_type: int, shape) -> None:
        """``new`` is an output; the next step reads it as ``state``."""
        self.outputs.append(_tensor_vi(new, elem_type, shape))
        self.binding.append((state, new))


def _check_choices(mode: str, optimizer) -> None:
    if mode not in ("eval", "train"):
        raise TrainingOpError(f"mode must be 'eval' or 'train', found {mode!r}")
    if not isinstance(optimizer, (Adam, Momentum, Adagrad, RMSProp)):
        raise TrainingOpError(
            f"optimizer must be onnx_training_ops.Adam, AdamW, Momentum, Adagrad or RMSProp, found "
            f"{type(optimizer).__name__}"
        )


def _forward(model: onnx.ModelProto, mode: str, seed: int, t_name: str, types,
             algo: _Algorithm) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """The forward pass the loss reads. ``"eval"``: the main graph itself (nothing to add).
    ``"train"``: a training-mode copy in the algorithm graph (:mod:`.train_mode`); returns
    the copy's names of main-graph values and the running-statistic updates."""
    if mode == "eval":
        return {}, []
    to_inference(model.graph)
    ranks = {name: len(vt.shape) for name, vt in types.items() if vt.shape is not None}
    forward, renamed, stat_updates = training_forward(
        model.graph, ranks, _default_opset(model), t_name, seed, algo.name)
    algo.nodes += forward
    return renamed, stat_updates


def _loss(model: onnx.ModelProto, loss, output, labels, types, renamed,
          algo: _Algorithm) -> tuple[Loss | None, str, str, str]:
    """(the loss spec or None, loss name, eval-mode loss name, label input name or ""): the
    loss nodes, their label input and the loss as an output, or a scalar output of the model
    used as it is. The eval-mode loss (``mode="train"``: on the main graph, an output of no
    graph, so steps never run it) is what :meth:`TrainingSession.evaluate` computes."""
    outputs = {o.name: o for o in model.graph.output}
    spec = resolve(loss)
    if spec is None:
        _check_output_loss(loss, outputs, types)
        return None, loss, loss, ""
    loss_name, eval_name, target, loss_type, loss_nodes, label_vi = _loss_nodes(
        spec, model.graph, types, outputs, output, labels, algo.taken, renamed)
    algo.nodes += loss_nodes
    algo.inputs.append(label_vi)
    algo.outputs.append(_tensor_vi(loss_name, loss_type, []))
    if eval_name != loss_name:
        algo.value_info.append(_tensor_vi(eval_name, loss_type, []))
    return spec, loss_name, eval_name, target


def _learning_rates(groups: list[Group], params, algo: _Algorithm) -> None:
    """R of each group: a scalar input whose initializer holds the group's ``lr`` (schedules
    feed it); double when every trainable is double (exact float64 learning rates), else float."""
    r_double = all(p.data_type == TensorProto.DOUBLE for p in params)
    r_type, r_dtype = (TensorProto.DOUBLE, np.float64) if r_double else (TensorProto.FLOAT, np.float32)
    for group in groups:
        if group.learning_rate in algo.taken:
            raise TrainingOpError(f"the learning-rate input name {group.learning_rate!r} is already "
                                  "used in the model")
        algo.taken.add(group.learning_rate)
        algo.inputs.append(_tensor_vi(group.learning_rate, r_type, []))
        algo.inits.append(numpy_helper.from_array(np.array(group.optimizer.lr, r_dtype),
                                                  group.learning_rate))


def _clip(grads: list[str], params, clip_grad_norm, clip_grad_value, algo: _Algorithm) -> tuple[list[str], str]:
    """Clipping between the Gradient node and the optimizers (:mod:`.grad_clip`): by value,
    then by global norm (an output, ``grad_norm``, as torch's return value)."""
    dtypes = [helper.tensor_dtype_to_np_dtype(p.data_type) for p in params]
    if clip_grad_value is not None:
        nodes, grads = clip_by_value(grads, dtypes, clip_grad_value, algo.name)
        algo.nodes += nodes
    norm_name = ""
    if clip_grad_norm is not None:
        norm_name = algo.name("grad_norm")
        nodes, grads = clip_by_global_norm(grads, dtypes, clip_grad_norm, algo.name, norm_name)
        algo.nodes += nodes
        algo.outputs.append(_tensor_vi(norm_name, params[0].data_type, []))
    return grads, norm_name


def _decoupled_decay(group: Group, params, r_type: int, algo: _Algorithm) -> list[str]:
    """AdamW: ``X * (1 - R*w)`` for each parameter of ``group`` (the Adam node reads these)."""
    w = group.optimizer.decoupled_weight_decay
    r_dtype = helper.tensor_dtype_to_np_dtype(r_type)
    one, decay = algo.name(f"{group.learning_rate}.one"), algo.name(f"{group.learning_rate}.weight_decay")
    rw, keep = algo.name(f"{group.learning_rate}.decay"), algo.name(f"{group.learning_rate}.keep")
    algo.inits += [numpy_helper.from_array(np.array(1.0, r_dtype), one),
                   numpy_helper.from_array(np.array(w, r_dtype), decay)]
    algo.nodes += [helper.make_node("Mul", [group.learning_rate, decay], [rw], name=rw),
                   helper.make_node("Sub", [one, rw], [keep], name=keep)]
    by_name = {p.name: p for p in params}
    out = []
    for p in group.params:
        factor = keep
        if by_name[p].data_type != r_type:
            factor = algo.name(f"{keep}.{p}")
            algo.nodes.append(helper.make_node("Cast", [keep], [factor], to=by_name[p].data_type, name=factor))
        decayed = algo.name(f"{p}.decayed")
        algo.nodes.append(helper.make_node("Mul", [p, factor], [decayed], name=decayed))
        out.append(decayed)
    return out


def _update(params, groups: list[Group], loss_name: str, t_name: str, clip_grad_norm,
            clip_grad_value, algo: _Algorithm,
            tables: Sequence[sparse_updates_.Table] = ()) -> tuple[dict[str, str], str]:
    """T <- T + 1, one Gradient node for all ``params``, clipping, and one optimizer update
    per group (:func:`.update_graph.emit_update`: one multi-tensor node of the domain, or
    standard ops for RMSProp); every new value bound to its state. ``tables``
    (:mod:`.sparse_updates`) are differentiated at their lookups and updated by rows.
    Returns each optimizer state variable's name by ``"<param>\\0<state>"`` and the name of
    the norm before clipping ("" without clip_grad_norm)."""
    t_new, one = algo.name("optimizer.T.new"), algo.name("optimizer.one")
    algo.inits.append(numpy_helper.from_array(np.array(0, np.int64), t_name))
    algo.inits.append(numpy_helper.from_array(np.array(1, np.int64), one))
    algo.nodes.append(helper.make_node("Add", [t_name, one], [t_new],
                                       name=algo.name("optimizer/T_increment")))

    by_rows = {tb.name: tb for tb in tables}
    if by_rows and (clip_grad_norm is not None or clip_grad_value is not None):
        raise TrainingOpError("gradient clipping with sparse_updates is not supported: the table "
                              f"gradients of {sorted(by_rows)} are rows, not tensors")
    p_names = [p.name for p in params]
    xs = [n for n in p_names if n not in by_rows] + [o for tb in tables for _, o in tb.lookups]
    raw = {x: algo.name(f"{x}.grad") for x in xs}
    algo.nodes.append(helper.make_node("Gradient", xs, list(raw.values()), domain=DOMAIN, xs=xs,
                                       y=loss_name, name=algo.name("gradient")))
    dense = [p for p in params if p.name not in by_rows]
    clipped, norm_name = _clip([raw[p.name] for p in dense], dense, clip_grad_norm, clip_grad_value, algo)
    grad_of = dict(zip((p.name for p in dense), clipped))
    by_name = {p.name: p for p in params}
    r_type = next(vi for vi in algo.inputs if vi.name == groups[0].learning_rate).type.tensor_type.elem_type
    t_input = {True: t_new, False: t_name}

    state_names: dict[str, str] = {}
    for group in groups:
        optimizer, names = group.optimizer, group.params
        states = {s: [algo.name(f"{p}.{s}") for p in names] for s in optimizer.states}
        new_params = {p: algo.name(f"{p}.new") for p in names}
        new_states = {s: [algo.name(f"{p}.{s}.new") for p in names] for s in optimizer.states}
        ops = Ops(algo.name, algo.nodes, "optimizer")
        label = "" if len(groups) == 1 else f"/{group.name}"
        t = t_input[bool(optimizer.t_offset)]
        rows = [i for i, p in enumerate(names) if p in by_rows]
        cols = [i for i, p in enumerate(names) if p not in by_rows]
        if cols:
            dense_names = [names[i] for i in cols]
            decoupled = getattr(optimizer, "decoupled_weight_decay", 0.0)
            sub = Group(group.name, optimizer, dense_names, group.learning_rate)
            xs_in = _decoupled_decay(sub, params, r_type, algo) if decoupled else dense_names
            emit_update(ops, optimizer, group.learning_rate, t, xs_in, [grad_of[p] for p in dense_names],
                        {s: [v[i] for i in cols] for s, v in states.items()},
                        [new_params[p] for p in dense_names],
                        {s: [v[i] for i in cols] for s, v in new_states.items()},
                        [helper.tensor_dtype_to_np_dtype(by_name[p].data_type) for p in dense_names],
                        label=label)
        for i in rows:
            tb = by_rows[names[i]]
            if getattr(optimizer, "decoupled_weight_decay", 0.0):
                raise TrainingOpError(f"sparse_updates of {tb.name!r}: AdamW's decoupled weight decay "
                                      "is not supported on row updates; use Adam(weight_decay=...)")
            unique, grad_rows = sparse_updates_.gradient_rows(ops, tb, [raw[o] for _, o in tb.lookups])
            sparse_updates_.emit_table_update(ops, optimizer, tb, group.learning_rate, t, unique, grad_rows,
                                              {s: v[i] for s, v in states.items()}, new_params[names[i]],
                                              {s: v[i] for s, v in new_states.items()})
        for p in names:
            algo.bind(p, new_params[p], by_name[p].data_type, by_name[p].dims)
        for s in optimizer.states:
            for p, state, new in zip(names, states[s], new_states[s]):
                algo.bind(state, new, by_name[p].data_type, by_name[p].dims)
                state_names[f"{p}\0{s}"] = state
    algo.bind(t_name, t_new, TensorProto.INT64, [])
    return state_names, norm_name


def _training_info(algo: _Algorithm, initialization: onnx.GraphProto,
                   init_binding) -> onnx.TrainingInfoProto:
    info = onnx.TrainingInfoProto()
    info.initialization.CopyFrom(initialization)
    info.algorithm.CopyFrom(helper.make_graph(algo.nodes, "algorithm", algo.inputs, algo.outputs,
                                              initializer=algo.inits, value_info=algo.value_info))
    for key, value in init_binding:
        info.initialization_binding.add(key=key, value=value)
    for key, value in algo.binding:
        info.update_binding.add(key=key, value=value)
    return info


def _finish(model: onnx.ModelProto, meta: dict[str, str]) -> onnx.ModelProto:
    """Versions the installed onnxruntime loads (IR >= 7 for training_info), the training
    domain's opset, and the builder's metadata (replacing an earlier build's)."""
    max_ir, _ = runtime_limits()
    model = fit_runtime(model)
    model.ir_version = max(min(model.ir_version or max_ir, max_ir), 7)
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, OPSET_VERSION))
    kept = [m for m in model.metadata_props if not m.key.startswith(META_PREFIX)]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    for key, value in meta.items():
        model.metadata_props.add(key=META_PREFIX + key, value=value)
    return model


def build_training_model(
    model,
    loss: str,
    optimizer: Optimizer,
    trainable=None,
    *,
    output: str | None = None,
    labels: str | None = None,
    learning_rate: str = "learning_rate",
    mode: str = "eval",
    seed: int = 0,
    param_groups: Sequence[Mapping] | None = None,
    clip_grad_norm: float | None = None,
    clip_grad_value: float | None = None,
    sparse_updates: Mapping[str, str] | None = None,
) -> onnx.ModelProto:
    """An ONNX training model (one ModelProto with ``training_info``) for ``model``.

    Parameters
    ----------
    model:
        an inference model (ModelProto, path or bytes), e.g. from ``onnx.helper`` or
        ``torch.onnx.export``. Opsets below 13 are converted.
    loss:
        a loss of :mod:`onnx_training_ops.losses` (``CrossEntropyLoss(...)``, ``MSELoss()``,
        ``L1Loss()``, ``HuberLoss()``, ``SmoothL1Loss()``, ``BCEWithLogitsLoss()``), one of
        their names (``"mse"``, ``"cross_entropy"``, ``"l1"``, ``"huber"``, ``"smooth_l1"``,
        ``"bce_with_logits"``; defaults as in torch) reading ``output`` and a new input
        (``labels`` int64 for cross-entropy, ``target`` shaped like the output otherwise),
        or the name of a scalar float output already in the model.
    optimizer:
        :class:`~onnx_training_ops.Adam`, :class:`~onnx_training_ops.AdamW`,
        :class:`~onnx_training_ops.Momentum` or :class:`~onnx_training_ops.Adagrad`.
    trainable:
        names of main-graph initializers to train; default: what torch would call the
        parameters — every float/double initializer of rank >= 1 with a differentiable path
        to the loss, except BatchNormalization's running statistics.
    output:
        the model output the loss reads; default the first output.
    labels:
        name of the new label/target input; default ``"labels"`` (cross_entropy) or ``"target"`` (mse).
    learning_rate:
        name of the algorithm graph's learning-rate input R (default value ``optimizer.lr``);
        other parameter groups get ``<learning_rate>.<group name>``.
    mode:
        ``"eval"`` (default): the loss reads the inference graph as it is. ``"train"``: the
        algorithm graph runs a training-mode copy of the forward pass, like torch's
        ``model.train()`` — BatchNormalization on batch statistics with its running
        statistics updated as state, Dropout with a fresh mask each step (see
        :mod:`onnx_training_ops.train_mode`); the main graph stays the eval-mode graph.
    seed:
        the dropout masks' seed (``mode="train"``): same seed, same masks.
    param_groups:
        torch-style parameter groups chosen by glob or regex patterns, with per-group
        optimizer values and ``frozen`` groups (:mod:`onnx_training_ops.param_groups`): one
        optimizer node and one learning-rate input per group.
    clip_grad_norm, clip_grad_value:
        gradient clipping as ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_``
        (:mod:`onnx_training_ops.grad_clip`); the norm before clipping is the output
        ``grad_norm`` that ``step`` returns.
    sparse_updates:
        ``{trainable name or glob pattern: "dense" | "lazy" | "sparse"}`` for embedding
        tables (trainables read only by axis-0 ``Gather``): gradients kept as (unique
        indices, summed rows) and, with ``"lazy"``, only the looked-up rows updated
        (torch ``SparseAdam``); ``"sparse"`` is TensorFlow's sparse apply. See
        :mod:`onnx_training_ops.sparse_updates`.
    """
    _check_choices(mode, optimizer)
    clip_grad_norm = checked_limit("clip_grad_norm", clip_grad_norm)
    clip_grad_value = checked_limit("clip_grad_value", clip_grad_value)
    model = _fit_opset(load_model(model))
    if mode == "train":
        model = fit_opset(model)  # Dropout masks need opset 18
    if model.training_info:
        raise TrainingOpError("the model already has training_info; pass the inference model")
    types = value_types(model)
    elem_types = {name: vt.elem_type for name, vt in types.items()}
    algo = _Algorithm(all_names(model.graph))

    t_name = algo.name("optimizer.T")  # the update count, also the dropout masks' counter
    renamed, stat_updates = _forward(model, mode, seed, t_name, types, algo)
    spec, loss_name, eval_loss, target = _loss(model, loss, output, labels, types, renamed, algo)
    candidates = _trainables(model, trainable, algo.nodes, loss_name, elem_types)
    groups, frozen = resolve_groups([p.name for p in candidates], param_groups, optimizer, learning_rate)
    params = [p for p in candidates if p.name not in frozen]
    _check_differentiable(model, algo.nodes, loss_name, params, elem_types)

    _learning_rates(groups, params, algo)
    modes = sparse_updates_.resolve_modes(sparse_updates, [p.name for p in params])
    tables = sparse_updates_.find_tables(modes, params, list(model.graph.node) + algo.nodes,
                                         algo.nodes if mode == "train" else model.graph.node)
    state_names, norm_name = _update(params, groups, loss_name, t_name, clip_grad_norm,
                                     clip_grad_value, algo, tables)
    initialization, init_binding = _initialization(params, groups, state_names, t_name,
                                                   algo.taken, algo.inits)
    inits = {t.name: t for t in model.graph.initializer}
    for stat, new in stat_updates:  # running statistics (mode="train"): state, not trained
        algo.bind(stat, new, inits[stat].data_type, inits[stat].dims)
    model.training_info.append(_training_info(algo, initialization, init_binding))

    outputs = {o.name: o for o in model.graph.output}
    meta = {
        "optimizer": to_json(optimizer),
        "loss": loss_name,
        "labels": target,
        "label_range": _label_range(spec, types, outputs, output),
        "learning_rate": learning_rate,
        "trainable": ",".join(p.name for p in params),
        # each trainable's optimizer state variables (what sharding the state must keep together)
        "optimizer_state": json.dumps({p.name: [v for k, v in state_names.items() if k.split("\0")[0] == p.name]
                                       for p in params}),
        "mode": mode,
        "seed": str(seed),
    }
    if eval_loss != loss_name:
        meta["eval_loss"] = eval_loss
    if param_groups is not None:
        meta["param_groups"] = groups_to_json(groups)
    if norm_name:
        meta["grad_norm"] = norm_name
    if modes:
        meta["sparse_updates"] = json.dumps(modes)
    return _finish(model, meta)


def metadata(model: onnx.ModelProto) -> dict[str, str]:
    """The builder's metadata of ``model`` (keys without the ``onnx_training_ops.`` prefix)."""
    return {m.key[len(META_PREFIX):]: m.value for m in model.metadata_props if m.key.startswith(META_PREFIX)}
