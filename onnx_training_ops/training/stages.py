"""The stages of a training step, cut out of the model's one algorithm: evaluate, backward, apply.

A training model's algorithm (``training_info[0]``) reads as forward -> loss -> ``Gradient``
-> (clipping, decay) -> optimizer nodes. The stages are derived from it, so the model stays
the one spec-valid, self-describing file and a ``step`` stays one onnxruntime run; the
convention is the ``Gradient`` node's outputs, where a step splits:

* **evaluate**: the eval-mode loss (the builder's ``eval_loss``, else the loss) and any
  requested values, no state written;
* **backward**: everything up to the Gradient node's outputs; each gradient ``G`` is added
  into an accumulator ``G.accumulated`` (times the feed ``grad_scale``), and state updated
  outside the optimizer (BatchNorm running statistics) is updated as in a step;
* **apply**: what the optimizer does with the gradients, reading the accumulators instead:
  clipping, weight decay, the optimizer nodes and ``T <- T + 1``.

A binding belongs to *apply* when its new value depends on a gradient or feeds an optimizer
node, its state is an optimizer input (X, V, H, T), or its new value depends on no feed (a
counter such as T: once per optimizer step); every other binding — state computed from the
batch, like BatchNorm running statistics — to *backward*.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import TrainingOpError
from ..passes._graph import value_types
from ..schema import DOMAIN, OPTIMIZERS
from .program import _reads

GRAD_SCALE = "onnx_training_ops.grad_scale"


@dataclass
class Stages:
    """The derived models and the accumulators (gradient name -> (accumulator, parameter))."""

    backward: onnx.ModelProto
    apply: onnx.ModelProto
    accumulators: dict[str, tuple[str, str]]


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    derived = onnx.ModelProto()
    derived.CopyFrom(model)
    return derived


def _gradient_nodes(algo: onnx.GraphProto) -> list[onnx.NodeProto]:
    return [n for n in algo.node if n.domain == DOMAIN and n.op_type == "Gradient"]


def _descendants(nodes, sources: set[str]) -> set[str]:
    """Every value computed from ``sources`` (nodes in topological order)."""
    reached = set(sources)
    for node in nodes:
        if any(name in reached for name in _reads(node)):
            reached.update(o for o in node.output if o)
    return reached


def evaluation_model(model: onnx.ModelProto, loss: str, outputs: list[str]) -> onnx.ModelProto:
    """The model whose algorithm outputs ``loss`` and ``outputs`` and binds nothing.
    ``outputs`` may name any value of the main graph (an output, or an inner value whose
    type shape inference knows) or an output of the algorithm."""
    derived = _copy(model)
    info = derived.training_info[0]
    known = {vi.name: vi for g in (model.graph, info.algorithm)
             for vi in (*g.value_info, *g.output)}
    types = None
    del info.update_binding[:]
    del info.algorithm.output[:]
    for name in dict.fromkeys([loss, *outputs]):
        if name not in known:
            types = value_types(model) if types is None else types
            vt = types.get(name)
            if vt is None or not vt.elem_type:
                raise TrainingOpError(
                    f"evaluate: {name!r} is not a value of the model with a known type; outputs: "
                    f"{', '.join(o.name for o in model.graph.output)}")
            known[name] = helper.make_tensor_value_info(name, vt.elem_type, None)
        info.algorithm.output.append(known[name])
    return derived


def split_stages(model: onnx.ModelProto) -> Stages:
    """The backward and apply models of ``model`` (see the module doc)."""
    if len(model.training_info) != 1:
        raise TrainingOpError(f"backward/optimizer_step need a model with one training_info, "
                              f"found {len(model.training_info)}")
    info = model.training_info[0]
    algo = info.algorithm
    gradient_nodes = _gradient_nodes(algo)
    if not gradient_nodes:
        raise TrainingOpError("backward/optimizer_step need a Gradient node in the algorithm "
                              "(where a step splits into backward and apply); this model has none")
    grads = {}
    for node in gradient_nodes:
        xs = [x.decode() for a in node.attribute if a.name == "xs" for x in a.strings]
        grads.update(zip(node.output, xs))
    nodes = [*model.graph.node, *algo.node]
    from_grads = _descendants(nodes, set(grads))
    optimizer_inputs = {i for n in algo.node if n.domain == DOMAIN and n.op_type in OPTIMIZERS
                        for i in n.input}
    inits = {t.name for t in (*model.graph.initializer, *algo.initializer)}
    feeds = {i.name for i in (*model.graph.input, *algo.input) if i.name not in inits}
    from_feeds = _descendants(nodes, feeds)
    # apply: what the gradients or an optimizer make, and counters the batch does not touch (T)
    applied = [e for e in info.update_binding
               if e.value in from_grads or e.value in optimizer_inputs or e.key in optimizer_inputs
               or e.value not in from_feeds]
    kept = [e for e in info.update_binding if e not in applied]
    outputs = {o.name: o for o in algo.output}
    bound = {e.value for e in info.update_binding}
    types = _grad_types(model, grads)
    taken = {o for n in nodes for o in n.output} | {t.name for t in model.graph.initializer} | \
        {t.name for t in algo.initializer} | {i.name for i in (*model.graph.input, *algo.input)}

    def unique(base: str) -> str:
        name, k = base, 1
        while name in taken:
            k += 1
            name = f"{base}.{k}"
        taken.add(name)
        return name

    accumulators = {g: (unique(f"{g}.accumulated"), x) for g, x in grads.items()}

    backward = _copy(model)
    b_info = backward.training_info[0]
    b_algo = b_info.algorithm
    del b_info.update_binding[:]
    b_info.update_binding.extend(kept)
    del b_algo.output[:]
    b_algo.output.extend(o for o in algo.output if o.name not in bound and o.name not in from_grads)
    b_algo.output.extend(outputs[e.value] for e in kept if e.value in outputs)
    b_algo.input.append(helper.make_tensor_value_info(GRAD_SCALE, TensorProto.DOUBLE, []))
    for g, (acc, _) in accumulators.items():
        elem, dims = types[g]
        scale, scaled, new = unique(f"{g}.scale"), unique(f"{g}.scaled"), unique(f"{acc}.new")
        b_algo.initializer.append(_zeros(acc, elem, dims))
        b_algo.node.extend([
            helper.make_node("Cast", [GRAD_SCALE], [scale], to=elem, name=scale),
            helper.make_node("Mul", [g, scale], [scaled], name=scaled),
            helper.make_node("Add", [acc, scaled], [new], name=new),
        ])
        b_algo.output.append(helper.make_tensor_value_info(new, elem, dims))
        b_info.update_binding.add(key=acc, value=new)

    apply = _copy(model)
    a_info = apply.training_info[0]
    a_algo = a_info.algorithm
    del a_info.update_binding[:]
    a_info.update_binding.extend(applied)
    rename = {g: acc for g, (acc, _) in accumulators.items()}
    a_nodes = [n for n in a_algo.node if not (n.domain == DOMAIN and n.op_type == "Gradient")]
    for node in a_nodes:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
    del a_algo.node[:]
    a_algo.node.extend(a_nodes)
    for g, (acc, _) in accumulators.items():
        elem, dims = types[g]
        a_algo.initializer.append(_zeros(acc, elem, dims))
    del a_algo.output[:]
    a_algo.output.extend(o for o in algo.output if o.name not in bound and o.name in from_grads)
    a_algo.output.extend(outputs[e.value] for e in applied if e.value in outputs)
    return Stages(backward, apply, accumulators)


def _zeros(name: str, elem: int, dims: list[int]) -> onnx.TensorProto:
    return numpy_helper.from_array(np.zeros(dims, helper.tensor_dtype_to_np_dtype(elem)), name)


def _grad_types(model: onnx.ModelProto, grads: dict[str, str]) -> dict[str, tuple[int, list[int]]]:
    """Each gradient's (elem type, dims): those of its parameter, an initializer."""
    inits = {t.name: t for t in (*model.graph.initializer, *model.training_info[0].algorithm.initializer)}
    out = {}
    for g, x in grads.items():
        if x not in inits:
            raise TrainingOpError(f"backward: the Gradient node's x {x!r} is not an initializer "
                                  "(accumulators take its type and shape)")
        out[g] = (inits[x].data_type, list(inits[x].dims))
    return out
