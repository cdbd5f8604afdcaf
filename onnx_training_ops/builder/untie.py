"""Parameters the TorchScript exporter merged because their values were equal, given back their own tensors.

``torch.onnx.export(dynamo=False)`` deduplicates initializers by value: of several torch
parameters holding equal tensors (fresh LayerNorm weights of 1, zero biases, a new head) it
keeps one initializer and names the others through ``Identity`` nodes (``Identity(
embeddings.LayerNorm.bias) -> encoder.layer.1.output.LayerNorm.bias``). Trained as exported,
those parameters would be one tensor with the sum of their gradients: BERT-tiny's 41 torch
parameters became 21 trainables. :func:`untie_merged_initializers` turns each such alias
back into an initializer of its own, a copy of the value, so each trains apart, as in torch.

A true tie (GPT-2's ``lm_head.weight``, which *is* ``wte.weight``: one torch parameter) is
exported as one initializer read directly, with no ``Identity`` alias, and stays tied. The
aliases are recognised by their names: a parameter's name, not one of the exporter's node
outputs (``/path/Op_output_0``, ``onnx::Op_12``).
"""

from __future__ import annotations

import onnx

FLOAT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
               onnx.TensorProto.BFLOAT16)


def _parameter_name(name: str) -> bool:
    return bool(name) and not name.startswith("/") and "::" not in name


def untie_merged_initializers(model: onnx.ModelProto) -> list[tuple[str, str]]:
    """In place: each ``Identity`` of a float initializer (rank >= 1) whose output carries a
    parameter's name becomes an initializer of that name holding a copy of the value.
    Returns the (kept initializer, alias given its own tensor) pairs."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    keep = {o.name for o in graph.output}
    untied: list[tuple[str, str]] = []
    nodes = []
    for node in graph.node:
        source = inits.get(node.input[0]) if node.op_type == "Identity" and node.domain in ("", "ai.onnx") \
            and len(node.input) == 1 and len(node.output) == 1 else None
        alias = node.output[0] if source is not None else ""
        if source is None or source.data_type not in FLOAT_TYPES or not source.dims \
                or not _parameter_name(alias) or alias in keep or alias in inits:
            nodes.append(node)
            continue
        copy = onnx.TensorProto()
        copy.CopyFrom(source)
        copy.name = alias
        graph.initializer.append(copy)
        untied.append((source.name, alias))
    if untied:
        del graph.node[:]
        graph.node.extend(nodes)
    return untied


def describe(untied: list[tuple[str, str]]) -> str:
    """The build-time note: how many, and the first few."""
    shown = ", ".join(f"{alias} (was {source})" for source, alias in untied[:3])
    more = f" and {len(untied) - 3} more" if len(untied) > 3 else ""
    return (f"{len(untied)} initializer(s) the TorchScript exporter had merged with an equal one are tensors "
            f"of their own again, as in torch (each trains, or keeps its running statistics, apart): {shown}{more}. "
            "A parameter torch ties (one tensor used twice, e.g. GPT-2's lm_head) is exported without an alias "
            "and stays tied")
