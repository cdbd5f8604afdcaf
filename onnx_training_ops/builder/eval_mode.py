"""The main graph of a ``mode="train"`` model: the eval-mode inference graph.

:func:`to_inference` turns a model exported in training mode to eval mode
(:func:`eval_mode_nodes`) and gives every BatchNormalization running statistics of its own
(:func:`untie_running_statistics`): :mod:`.train_mode` updates each apart, as torch does.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import TrainingOpError
from ..passes._graph import all_names, unique_name
from ..walk import all_graphs
from ._nodes import is_standard as _is
from ._nodes import label as _label


def to_inference(graph: onnx.GraphProto) -> None:
    """The main graph of a ``mode="train"`` model, in place: eval-mode nodes
    (:func:`eval_mode_nodes`) and one running-statistic initializer per BatchNormalization
    (:func:`untie_running_statistics`)."""
    eval_mode_nodes(graph)
    untie_running_statistics(graph)


def eval_mode_nodes(graph: onnx.GraphProto) -> None:
    """A model exported in training mode, turned to eval mode: Dropout without its
    ``training_mode`` input, BatchNormalization without ``training_mode`` and with its one
    output (opset >= 14 says training by the attribute, older opsets by 5 outputs)."""
    read = _read_names(graph)
    for node in graph.node:
        if _is(node, "Dropout") and len(node.input) > 2:
            del node.input[2:]
        if _is(node, "BatchNormalization"):
            kept = [a for a in node.attribute if a.name != "training_mode"]
            del node.attribute[:]
            node.attribute.extend(kept)
            used = [o for o in node.output[1:] if o and o in read]
            if used:
                raise TrainingOpError(
                    f"BatchNormalization node {_label(node)!r}: its training-mode output(s) "
                    f"{used} are read; mode='train' computes the running statistics itself")
            del node.output[1:]


def untie_running_statistics(graph: onnx.GraphProto) -> None:
    """Give every BatchNormalization its own running mean and variance initializers.

    torch's TorchScript exporter merges equal tensors: a fresh model's running statistics
    reach its BatchNorms through ``Identity`` nodes from *one* initializer (another BN's
    statistics, or even a BN weight of ones or a bias of zeros). Training updates each BN's
    statistics separately, so each gets an initializer of its own. A statistic that only
    BatchNorms read keeps its name (``bn2.running_var``, torch's buffer name) for the first
    of them; the Identity or Constant that produced it goes.
    """
    taken = all_names(graph)
    inits = {t.name: t for t in graph.initializer}

    def own_copy(node, slot, value):
        what = "running_mean" if slot == 3 else "running_var"
        name = unique_name(taken, f"{_label(node)}.{what}")
        graph.initializer.append(numpy_helper.from_array(value.copy(), name))
        inits[name] = graph.initializer[-1]
        node.input[slot] = name

    # produced values (Identity chains, Constants) become initializers
    slots = _stat_slots(graph)
    producers = {o: n for n in graph.node for o in n.output if o}
    read, stat_read = _read_counts(graph), _stat_read_counts(slots)
    for node, slot in slots:
        name = node.input[slot]
        value = None if name in inits else _constant_source(name, producers, inits)
        if value is None:
            continue
        if read.get(name, 0) == stat_read[name]:  # only statistics read it: it becomes one
            graph.initializer.append(numpy_helper.from_array(value.copy(), name))
            inits[name] = graph.initializer[-1]
        else:
            own_copy(node, slot, value)
    _drop_unread(graph, set(inits))

    # an initializer read by several statistics, or by anything else too, is copied
    slots = _stat_slots(graph)  # _drop_unread rebuilt the node list
    read, stat_read = _read_counts(graph), _stat_read_counts(slots)
    kept: set[str] = set()
    for node, slot in slots:
        name = node.input[slot]
        if name not in inits or read.get(name, 0) == 1:
            continue
        if read[name] == stat_read[name] and name not in kept:
            kept.add(name)
        else:
            own_copy(node, slot, numpy_helper.to_array(inits[name]))


def _stat_slots(graph: onnx.GraphProto) -> list[tuple[onnx.NodeProto, int]]:
    """(BatchNormalization node, input index) of every running mean and variance."""
    return [(node, slot) for node in graph.node if _is(node, "BatchNormalization")
            for slot in (3, 4)]


def _stat_read_counts(slots) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node, slot in slots:
        counts[node.input[slot]] = counts.get(node.input[slot], 0) + 1
    return counts


def _constant_source(name: str, producers, sources) -> np.ndarray | None:
    """The value ``name`` holds if it is an initializer or an Identity chain / Constant."""
    while name not in sources:
        node = producers.get(name)
        if node is None:
            return None
        if _is(node, "Identity"):
            name = node.input[0]
        elif _is(node, "Constant") and node.attribute and node.attribute[0].name == "value":
            return numpy_helper.to_array(node.attribute[0].t)
        else:
            return None
    return numpy_helper.to_array(sources[name])


def _read_names(graph: onnx.GraphProto) -> set[str]:
    return set(_read_counts(graph))


def _read_counts(graph: onnx.GraphProto) -> dict[str, int]:
    """How many times each name is read: node inputs (subgraphs included) and graph outputs."""
    counts: dict[str, int] = {}
    for g in all_graphs(graph):
        for node in g.node:
            for name in node.input:
                if name:
                    counts[name] = counts.get(name, 0) + 1
    for o in graph.output:
        counts[o.name] = counts.get(o.name, 0) + 1
    return counts


def _drop_unread(graph: onnx.GraphProto, now_initializers: set[str]) -> None:
    """Remove Identity/Constant nodes that produce a name now held by an initializer, then
    those whose outputs nobody reads any more."""
    keep = [n for n in graph.node if not any(o in now_initializers for o in n.output)]
    while True:
        del graph.node[:]
        graph.node.extend(keep)
        read = _read_counts(graph)
        pruned = [n for n in keep if not ((_is(n, "Identity") or _is(n, "Constant"))
                                         and not any(read.get(o) for o in n.output))]
        if len(pruned) == len(keep):
            return
        keep = pruned
