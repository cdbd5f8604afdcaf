"""Pass: make a guarded step write its state only after every node that reads the old state ran.

A step whose new state is guarded (:func:`.guard_feedback.guard_feedback`: each new value is
``Where(ok, new, old)``) can write it over the old state when no node reads a state variable
after its new value is written (:func:`.guard_feedback.in_place_unsafe`). The flat optimizer
(:func:`.flatten_optimizers.flatten_optimizers`) updates its tensors in groups of at most 32,
one chain each: a group of the last layers' parameters needs only their gradients, so
onnxruntime may run its update, and write those parameters, before the backward of the first
layers has read them (GPT-2 124M: 148 tensors, five groups; every LoRA model past 32
adapter matrices). The step then had to write a second set of buffers, which rules out fixed
addresses and CUDA graphs.

This pass ANDs into the guard's condition one ``True`` computed from an element of a value
that depends on those reads, per value needed: ``Or(Cast(x[0], bool), True)``. It changes no
value (the condition is the same bool), costs four tiny nodes each, and makes every write wait
for the reads: onnxruntime orders nodes by their data dependencies only. The values are the
update chains' outputs (each group's new parameters), so a few cover a whole step (one per
group that an unsafe read feeds).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ._graph import ValueType, all_names, unique_name, value_types
from .guard_feedback import in_place_unsafe, node_reads, state_readers

PASS_THROUGH = {"Reshape", "Identity", "Flatten", "Squeeze", "Unsqueeze", "Slice"}
"""Ops a new value is cut from its group's buffer with: the barrier reads the buffer."""


def _source(graph: onnx.GraphProto, producer: Mapping[str, int], name: str, constants: set[str]) -> str:
    """``name`` followed up through the ops that cut it from a bigger value, to that value."""
    while name in producer:
        node = graph.node[producer[name]]
        data = [i for i in node.input if i and i not in constants]
        if node.op_type not in PASS_THROUGH or node.domain not in ("", "ai.onnx") or len(data) != 1:
            break
        name = data[0]
    return name


def _ancestors(reads: list[set[str]], producer: Mapping[str, int], name: str) -> set[int]:
    found: set[int] = set()
    pending = [producer[name]] if name in producer else []
    while pending:
        i = pending.pop()
        if i in found:
            continue
        found.add(i)
        pending.extend(producer[n] for n in reads[i] if n in producer)
    return found


def writes_after_reads(model: onnx.ModelProto, written: Mapping[str, str], unsafe: Sequence[str] | None = None
                       ) -> list[str]:
    """Make ``model``'s guarded writes (state -> the ``Where`` output written over it) wait for
    every read of the old state, when its unsafe reads all feed some new value (in place).

    Args:
        model: a step model guarded by :func:`.guard_feedback.guard_feedback`.
        written: what it returned.
        unsafe: :func:`.guard_feedback.in_place_unsafe` of the two, if known.

    Returns:
        The values the barrier reads (empty: nothing was unsafe, or no barrier could order the
        reads, and ``model`` is unchanged).
    """
    unsafe = in_place_unsafe(model, written) if unsafe is None else unsafe
    if not unsafe:
        return []
    graph = model.graph
    reads = [node_reads(node) for node in graph.node]
    producer = {out: i for i, node in enumerate(graph.node) for out in node.output if out}
    wheres = [graph.node[producer[out]] for out in written.values() if out in producer]
    conditions = {w.input[0] for w in wheres if w.op_type == "Where" and w.domain in ("", "ai.onnx")}
    if len(wheres) != len(written) or len(conditions) != 1:
        return []  # not guard_feedback's form
    consumers: dict[str, list[int]] = {}
    for i, names in enumerate(reads):
        for name in names:
            consumers.setdefault(name, []).append(i)
    writers = {id(w) for w in wheres}
    stale = {i for state in unsafe for i in state_readers(graph, consumers, state)
             if id(graph.node[i]) not in writers}
    constants = {t.name for t in graph.initializer}
    sources = sorted({_source(graph, producer, w.input[1], constants) for w in wheres})
    types = value_types(model)
    usable = [s for s in sources if s in producer and _has_elements(types.get(s))]
    covers = {s: stale & _ancestors(reads, producer, s) for s in usable}
    chosen, left = [], set(stale)
    while left:
        best = max(usable, key=lambda s: len(covers[s] & left), default=None)
        if best is None or not covers[best] & left:
            return []  # a read that feeds no new value: two sets
        chosen.append(best)
        left -= covers[best]
    _and_into(graph, conditions.pop(), chosen, wheres)
    return chosen


def _and_into(graph: onnx.GraphProto, condition: str, values: list[str], wheres: list[onnx.NodeProto]) -> None:
    """``condition`` ANDed with an always-true bool read from an element of each of ``values``,
    in every ``Where`` of ``wheres`` (moved after the new nodes: the graph stays sorted)."""
    taken = all_names(graph)
    constants = {hint: unique_name(taken, f"order_writes/{hint}") for hint in ("all", "first", "one", "scalar", "true")}
    graph.initializer.extend(numpy_helper.from_array(value, constants[hint]) for hint, value in (
        ("all", np.array([-1], np.int64)), ("first", np.array([0], np.int64)), ("one", np.array([1], np.int64)),
        ("scalar", np.zeros(0, np.int64)), ("true", np.array(True))))
    nodes, ok = [], condition
    for value in values:
        flat, element, scalar, cast, read, both = (unique_name(taken, f"{value}/order_writes/{hint}") for hint in
                                                   ("flat", "element", "scalar", "bool", "read", "ok"))
        nodes += [helper.make_node("Reshape", [value, constants["all"]], [flat]),
                  helper.make_node("Slice", [flat, constants["first"], constants["one"]], [element]),
                  helper.make_node("Reshape", [element, constants["scalar"]], [scalar]),
                  helper.make_node("Cast", [scalar], [cast], to=TensorProto.BOOL),
                  helper.make_node("Or", [cast, constants["true"]], [read]),
                  helper.make_node("And", [ok, read], [both])]
        ok = both
    for where in wheres:
        where.input[0] = ok
    moved = {id(w) for w in wheres}
    kept = [n for n in graph.node if id(n) not in moved]
    del graph.node[:]
    graph.node.extend([*kept, *nodes, *wheres])


__all__ = ["writes_after_reads"]


def _has_elements(value: ValueType | None) -> bool:
    """A value of a static shape with at least one element."""
    shape = None if value is None else value.static_shape
    return shape is not None and int(np.prod(shape)) > 0
