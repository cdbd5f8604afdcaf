"""Pass (native path, after the Gradient expansion): the batch statistics of a train-mode
BatchNormalization as one native ``TrainingBatchStats(x) -> (mean, var)``.

``builder/train_mode.py`` writes them as standard nodes (ReduceMean, Sub, Mul, ReduceMean and
two Reshapes to [C]); this pass finds that chain in front of the builder's node
(``BATCH_STATISTICS_DOC``) whose gradient is the native ``TrainingBatchNormGrad`` (so x is
float32) and computes both Reshape outputs in one node, two passes over x
(:mod:`onnx_training_ops.kernels._native_norm_kernels`). Nodes of the chain that something
else reads stay. Every other path keeps the standard form.
"""

from __future__ import annotations

from onnx import ModelProto, helper, numpy_helper

from ..autodiff.native_ops import BATCH_NORM_GRAD, BATCH_STATS, DOMAIN
from ..autodiff.rules_norm import BATCH_STATISTICS_DOC
from ..walk import model_graphs
from ._graph import all_names, unique_name


def batch_statistics_native(model: ModelProto) -> ModelProto:
    """Rewrite the statistics of every builder's BatchNormalization (in place; returns it)."""
    for graph in model_graphs(model):
        producer = {o: n for n in graph.node for o in n.output}
        readers: dict[str, int] = {}
        for n in graph.node:
            for i in n.input:
                readers[i] = readers.get(i, 0) + 1
        for o in graph.output:
            readers[o.name] = readers.get(o.name, 0) + 1
        # float32 x, proven by its native gradient (TrainingBatchNormGrad takes float32 only)
        native_x = {n.input[1] for n in graph.node if n.op_type == BATCH_NORM_GRAD and n.domain == DOMAIN}
        drop, new, taken = set(), {}, all_names(graph)
        for bn in graph.node:
            if bn.op_type == "BatchNormalization" and bn.doc_string == BATCH_STATISTICS_DOC \
                    and bn.input[0] in native_x:
                chain = _chain(bn, producer)
                if chain is not None:
                    reshapes, inner = chain
                    node = helper.make_node(BATCH_STATS, [bn.input[0]], [r.output[0] for r in reshapes],
                                            name=unique_name(taken, f"{bn.name}/statistics"), domain=DOMAIN)
                    new[id(reshapes[0])] = node
                    drop.add(id(reshapes[1]))
                    for r in reshapes:
                        readers[r.input[0]] -= 1
                        readers[r.input[1]] -= 1
                    for n in inner + [producer.get(r.input[1]) for r in reshapes]:  # outermost first
                        if n is not None and all(readers.get(o, 0) == 0 for o in n.output):
                            drop.add(id(n))
                            for i in n.input:
                                readers[i] = readers.get(i, 0) - 1
                                if readers[i] == 0 and i in producer and producer[i].op_type == "Constant":
                                    drop.add(id(producer[i]))  # an axes constant only it read
        if new:
            kept = [new.get(id(n), n) for n in graph.node if id(n) not in drop]
            del graph.node[:]
            graph.node.extend(kept)
    return model


def _chain(bn, producer):
    """((Reshape of mean, Reshape of var), [ReduceMean(sq), Mul, Sub, ReduceMean(x)]) of the
    builder's form, else None."""
    x = bn.input[0]
    mean_r, var_r = producer.get(bn.input[3]), producer.get(bn.input[4])
    if not (mean_r and var_r and mean_r.op_type == var_r.op_type == "Reshape"):
        return None
    mean, var = producer.get(mean_r.input[0]), producer.get(var_r.input[0])
    sq = producer.get(var.input[0]) if var is not None and var.op_type == "ReduceMean" else None
    sub = producer.get(sq.input[0]) if sq is not None and sq.op_type == "Mul" else None
    if not (mean is not None and mean.op_type == "ReduceMean" and mean.input[0] == x and sub is not None
            and sub.op_type == "Sub" and list(sub.input) == [x, mean.output[0]]
            and sq is not None and list(sq.input) == [sub.output[0]] * 2
            and _axes_ok(mean, producer) and _axes_ok(var, producer)
            and _flat(mean_r, producer) and _flat(var_r, producer)):
        return None
    return (mean_r, var_r), [var, sq, sub, mean]


def _constant(name, producer):
    node = producer.get(name)
    if node is None or node.op_type != "Constant" or not node.attribute or node.attribute[0].name != "value":
        return None
    return [int(v) for v in numpy_helper.to_array(node.attribute[0].t).reshape(-1)]


def _axes_ok(reduce, producer) -> bool:
    """A ReduceMean with keepdims over every axis but 1 (the builder's)."""
    axes = _constant(reduce.input[1], producer) if len(reduce.input) > 1 else next(
        (list(a.ints) for a in reduce.attribute if a.name == "axes"), None)
    keep = next((a.i for a in reduce.attribute if a.name == "keepdims"), 1)
    return axes is not None and keep == 1 and axes[:1] == [0] and axes[1:] == list(range(2, len(axes) + 1))


def _flat(reshape, producer) -> bool:
    return _constant(reshape.input[1], producer) == [-1]
